"""How optimizer state is stored and checkpointed, whatever the optimizer.

- ``storage``: float32, bfloat16 (rounded stochastically) or 8-/4-bit quantized state tensors, read and written by
  one update path.
- ``initialise``: the state made before the first step, so that it can be checkpointed or measured.
- ``quantized_checkpoint``: quantized state saved as plain float32 one tensor at a time, loaded a group at a time.
- ``torchao_import``: torchao's optimizer package, imported quietly, or one line saying how to install it.
"""
