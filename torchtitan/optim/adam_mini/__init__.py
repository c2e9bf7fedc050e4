"""Adam-mini: Adam's momentum per element, one second moment per block of rows.

- ``partition``: which rows of each weight form a block (the model's declared roles, then name rules); torch-free.
- ``layout``: those blocks on a parameter's local shard, and ``v`` laid out to match.
- ``statistics``: the block means of squared gradients, completed over the mesh where ranks split a block.
- ``foreach``, ``fused``: the two back ends of the update (foreach kernels; the fused one's operator for plain
  float tensors, ``one_pass`` with its CPU kernel (``csrc``, ``cpu_build``) and Triton kernel (``triton_step``,
  ``triton_kernel``), and compiled graphs per slice for the rest).
- ``optimizer``: ``AdamMini``, the ``torch.optim.Optimizer`` front, and ``adam_mini_update``, the update over lists
  of tensors.
"""

from torchtitan.moved import lazy_names

__getattr__ = lazy_names(
    __name__,
    {"AdamMini": f"{__name__}.optimizer", "adam_mini_update": f"{__name__}.optimizer"},
    former=f"{__name__}.optimizer",
)
