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
one line naming its new home.
"""

import importlib
import importlib.abc
import sys
from typing import Any, Callable, Optional

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

# The modules of the former flat layout, and where each one lives now.
MOVED_MODULES = {
    "torchtitan.optim.adam_mini_foreach": "torchtitan.optim.adam_mini.foreach",
    "torchtitan.optim.adam_mini_fused": "torchtitan.optim.adam_mini.fused",
    "torchtitan.optim.adam_mini_layout": "torchtitan.optim.adam_mini.layout",
    "torchtitan.optim.adam_mini_statistics": "torchtitan.optim.adam_mini.statistics",
    "torchtitan.optim.partition": "torchtitan.optim.adam_mini.partition",
    "torchtitan.optim.muon_distributed": "torchtitan.optim.muon.distributed",
    "torchtitan.optim.adamw_low_precision": "torchtitan.optim.lowbit.adamw",
    "torchtitan.optim.torchao_adapter": "torchtitan.optim.lowbit.torchao_adapter",
    "torchtitan.optim.state_storage": "torchtitan.optim.state.storage",
    "torchtitan.optim.state_init": "torchtitan.optim.state.initialise",
    "torchtitan.optim.quantized_checkpoint": "torchtitan.optim.state.quantized_checkpoint",
    "torchtitan.optim.normuon": "torchtitan.optim.muon.normuon",
    "torchtitan.optim.hyperparameters": "torchtitan.optim.settings",
}


def lazy_names(package: str, homes: dict[str, str], former: Optional[str] = None) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that imports each name of ``homes`` from its module on first use.

    ``former`` is the module that ``package``'s name was before it became a package: a name that module holds, asked
    of the package, fails with one line saying where to import it from; so does a module of the former flat layout
    (``from torchtitan.optim import partition``).
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is not None:
            return getattr(importlib.import_module(home), name)
        moved = MOVED_MODULES.get(f"{package}.{name}")
        if moved is not None:
            raise ImportError(f"{package}.{name} moved to {moved}: import it from there")
        if former is not None and not name.startswith("__") and hasattr(importlib.import_module(former), name):
            raise ImportError(f"{package} is a package now: import {name} from {former}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_names(__name__, _HOMES)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Asked after every real finder, so only for a module that does not exist: one line naming its new home."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        home = MOVED_MODULES.get(fullname)
        if home is not None:
            raise ModuleNotFoundError(f"{fullname} moved to {home}: import it from there", name=fullname)
        return None


if not any(type(finder).__name__ == _MovedModuleFinder.__name__ for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
