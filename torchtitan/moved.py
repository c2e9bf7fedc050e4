"""The package's former names: a module of a former layout fails to import with one line naming its new home, and
a package that was a module says where each of the module's names lives now. A leaf: imports nothing of the package."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable  # not typing: a job script's record imports this leaf, and typing costs it 7 ms

# The modules of former layouts, and where each one lives now.
MOVED_MODULES = {
    # the package's top floor, grouped by concern
    "torchtitan.config_manager": "torchtitan.config.job_config",
    "torchtitan.legacy_config": "torchtitan.config.legacy",
    "torchtitan.preflight": "torchtitan.config.preflight",
    "torchtitan.guard": "torchtitan.training.guard",
    "torchtitan.loss": "torchtitan.training.loss",
    "torchtitan.lr_scheduling": "torchtitan.training.lr_scheduling",
    "torchtitan.validate": "torchtitan.training.validate",
    "torchtitan.preemption": "torchtitan.training.preemption",
    "torchtitan.garbage_collection": "torchtitan.training.garbage_collection",
    "torchtitan.metrics": "torchtitan.telemetry.metrics",
    "torchtitan.health": "torchtitan.telemetry.health",
    "torchtitan.step_timing": "torchtitan.telemetry.step_timing",
    "torchtitan.profiling": "torchtitan.telemetry.profiling",
    "torchtitan.collectives": "torchtitan.distributed.collectives",
    "torchtitan.process_tree": "torchtitan.distributed.process_tree",
    "torchtitan.cuda_allocator": "torchtitan.distributed.cuda_allocator",
    "torchtitan.utils": "torchtitan.distributed.utils",
    # the optimizers' former flat layout
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


def lazy_names(package: str, homes: dict[str, str], former: str | None = None) -> Callable[[str], object]:
    """A ``__getattr__`` for ``package`` that imports each name of ``homes`` from its module on first use.

    ``former`` is the module that ``package``'s name was before it became a package: a name that module holds, asked
    of the package, fails with one line saying where to import it from; so does a module of a former layout
    (``from torchtitan.optim import partition``).
    """

    def __getattr__(name: str) -> object:
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


class _MovedModuleFinder:  # a meta path finder (its find_spec): importlib.abc costs a job script's record 40 ms
    """Asked after every real finder, so only for a module that does not exist: one line naming its new home."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        home = MOVED_MODULES.get(fullname)
        if home is not None:
            raise ModuleNotFoundError(f"{fullname} moved to {home}: import it from there", name=fullname)
        return None


def install_finder() -> None:
    """Ask ``_MovedModuleFinder`` after every real finder (once per interpreter)."""
    if not any(type(finder).__name__ == _MovedModuleFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
