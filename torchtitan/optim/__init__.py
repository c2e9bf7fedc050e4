"""Optimizers: Adam-mini, the optimizer registry (``build_optimizers``) and the container the trainer uses.

The names below are imported on first use, so that the torch-free modules of this package (``hyperparameters``,
``partition``) can be imported by the job config without importing torch.
"""

import importlib

_HOMES = {
    "AdamMini": "torchtitan.optim.adam_mini",
    "OptimizersContainer": "torchtitan.optim.container",
    "build_optimizers": "torchtitan.optim.builder",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
