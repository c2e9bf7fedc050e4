"""torchao's optimizer package, imported once for every user of it: the low-bit optimizers (``lowbit``) and the
quantized state tensors (``state.storage``)."""

from __future__ import annotations

import logging

import torch

from torchtitan.errors import UserError


def import_torchao_optim():
    """``torchao.optim``, imported without its unrelated warnings; UserError saying how to install it if missing."""
    # torchao's import warns about things that do not concern its optimizers: CUDA kernels that a CPU-only machine
    # cannot load, and a deprecated pytree registration. Keep those lines out of the user's log.
    noisy = [logging.getLogger("torch.utils._pytree")]
    if not torch.cuda.is_available():
        noisy.append(logging.getLogger("torchao"))
    levels = [log.level for log in noisy]
    for log in noisy:
        log.setLevel(logging.ERROR)
    try:
        import torchao.optim as torchao_optim
    except ImportError as e:
        raise UserError(
            f"the low-bit optimizers need torchao, which is not importable ({e}); "
            "install it with: pip install 'torchtitan[lowbit]' (or pip install torchao)"
        ) from None
    finally:
        for log, level in zip(noisy, levels):
            log.setLevel(level)
    return torchao_optim
