"""Optimizers for the trainer, in layers that only import downwards.

On top, what the trainer calls:

- ``settings``: ``[optimizer]`` read, checked and resolved in one pass (``optimizer_settings``), with the tables of
  which optimizer takes which option (``TAKES``) and what each option does to a checkpoint (``OPTION_RULES``);
  torch-free, so the job config checks it too.
- ``builder``: the registry. ``build_optimizers`` turns the settings into one optimizer per model part; the
  ``OPTIMIZERS`` table maps each ``optimizer.name`` to its factory.
- ``container``: ``OptimizersContainer``, the optimizers of all model parts as one (loop, schedulers, checkpoints).

One package per optimizer family:

- ``adam_mini``: Adam-mini (block partition, blocks on a shard, block statistics, foreach and fused back ends).
- ``muon``: the Muon family (the update with its AdamW part; Newton–Schulz on sharded matrices).
- ``ademamix``: AdEMAMix (a fast and a slow momentum; element-wise, so DTensor shards step on their own).
- ``lowbit``: AdamW with moments in another dtype than the weights (``adamw``); torchao's 8-bit, 4-bit and FP8
  AdamW, adapted (``torchao_adapter``).

Below them, ``state``: how optimizer state is stored (float32, bfloat16, quantized), made before the first step, and
checkpointed one quantized tensor at a time. ``compiled_slices`` runs compiled steps for the back ends that compile.

The names below are imported on first use, so that importing ``settings`` or ``adam_mini.partition`` does
not import torch. A module of the former flat layout (``torchtitan.optim.state_storage``, ...) fails to import with
one line naming its new home (``torchtitan.moved``).
"""

from torchtitan.moved import lazy_names

_HOMES = {
    "AdEMAMix": "torchtitan.optim.ademamix.optimizer",
    "AdamMini": "torchtitan.optim.adam_mini.optimizer",
    "LowPrecisionAdam": "torchtitan.optim.lowbit.adamw",
    "Muon": "torchtitan.optim.muon.optimizer",
    "NorMuon": "torchtitan.optim.muon.normuon",
    "OptimizersContainer": "torchtitan.optim.container",
    "build_optimizers": "torchtitan.optim.builder",
}

__all__ = list(_HOMES)

__getattr__ = lazy_names(__name__, _HOMES)
