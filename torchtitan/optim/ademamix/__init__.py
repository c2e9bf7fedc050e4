"""AdEMAMix (Pagliardini et al. 2024, arXiv 2409.03137): Adam's update plus a slow momentum, mixed in with weight
alpha; alpha and the slow momentum's decay beta3 warm up over the run.

- ``update``: the schedules of alpha and beta3, and the update as a pure function over lists of local tensors.
- ``optimizer``: ``AdEMAMix``, the ``torch.optim.Optimizer`` front (state, step counts, storage in float32 or
  bfloat16). Element-wise, so a DTensor's shard steps on its own: no communication.
"""

from torchtitan.moved import lazy_names

__getattr__ = lazy_names(__name__, {"AdEMAMix": f"{__name__}.optimizer"}, former=f"{__name__}.optimizer")
