"""Low-bit and low-precision AdamW: moments stored in fewer bits than float32 AdamW keeps.

- ``adamw``: ``LowPrecisionAdam``, AdamW with bfloat16 moments (or float32 moments for bfloat16 weights).
- ``torchao_adapter``: torchao's 8-bit, 4-bit and FP8 AdamW, adapted to the trainer (a compile cache per kind,
  checkpoints of plain tensors).
"""
