"""A process of its own as one rank of a fake world, and torchao's quantization maps ready for fake tensors: what the
memory estimate and preflight's layout check both need to run a job's own code without memory or peers."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist

from torchtitan.errors import UserError
from torchtitan.optim.state.torchao_import import import_torchao_optim


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group: rank 0 of ``world_size``, collectives return at once without data."""
    if dist.is_initialized():
        raise RuntimeError("memory estimation needs a process without a process group; run it on its own")
    # Fake implementations of the c10d collectives for fake tensors.
    import torch.distributed._tools.fake_collectives  # noqa: F401
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def precompute_quantization_maps() -> None:
    """Compute torchao's cached quantization maps for real, before fake mode.

    torchao builds them once from Python lists read out of tensors, which fake tensors (having no values) cannot
    give; once cached, the low-bit optimizers create their state on fake parameters with their own code.
    """
    for module_name in ("torchao.optim.subclass_4bit", "torchao.optim.subclass_8bit"):
        try:
            import_torchao_optim()
            module = importlib.import_module(module_name)
        except (ImportError, UserError):
            continue
        for function_name in ("get_qmap_signed", "get_qmap_unsigned"):
            function = getattr(module, function_name, None)
            if function is not None:
                function()
