"""How an optimizer's per-element state is stored: float32, bfloat16, or 8-/4-bit block-quantized (torchao).

Storage is a property of the state tensor, not of the update: an update reads a state as a plain tensor of the
compute dtype (``read_state``), does its math there, and writes the result back with ``copy_``, which rounds to the
storage (round-to-nearest for bfloat16; blockwise quantization for the torchao tensors). The quantized tensors are
torchao's ``OptimState8bit`` / ``OptimState4bit`` (the ones its AdamW8bit/AdamW4bit keep), wrapped in a DTensor
exactly when the parameter is one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

FLOAT32, BFLOAT16, INT8, INT4 = "float32", "bfloat16", "int8", "int4"
STATE_DTYPES = (FLOAT32, BFLOAT16)  # what [optimizer] state_dtype offers
DEFAULT_BLOCK_SIZE = {INT8: 256, INT4: 128}  # torchao's defaults for its 8- and 4-bit moments
# Like torchao (after bitsandbytes): tensors smaller than this keep float32 state even when quantized is asked for.
MIN_QUANTIZED_NUMEL = 4096


def new_state(param: Tensor, storage: str, block_size: int | None = None, signed: bool = True) -> Tensor:
    """Zeros shaped like ``param`` (a DTensor with its layout when ``param`` is one), stored as ``storage``."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if storage in (INT8, INT4):
        out = _quantized_zeros(local, storage, block_size or DEFAULT_BLOCK_SIZE[storage], signed)
    elif storage == BFLOAT16:
        out = torch.zeros_like(local, dtype=torch.bfloat16, memory_format=torch.preserve_format)
    elif storage == FLOAT32:
        out = torch.zeros_like(local, memory_format=torch.preserve_format)  # like the parameter
    else:
        raise ValueError(f"unknown state storage {storage!r}")
    if not isinstance(param, DTensor):
        return out
    # Local shards may differ in shape between ranks (uneven first dimension): give the global shape explicitly.
    return DTensor.from_local(
        out, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _quantized_zeros(local: Tensor, storage: str, block_size: int, signed: bool) -> Tensor:
    if local.numel() < MIN_QUANTIZED_NUMEL or local.numel() % block_size:
        return torch.zeros_like(local)
    from torchtitan.optim.torchao_adapter import import_torchao_optim

    import_torchao_optim()  # a clear error when torchao is missing
    if storage == INT8:
        from torchao.optim.subclass_8bit import OptimState8bit as cls
    else:
        from torchao.optim.subclass_4bit import OptimState4bit as cls
    return cls.zeros(local.shape, signed=signed, block_size=block_size, device=local.device)


def is_quantized(value: Any) -> bool:
    """A torchao quantized state tensor (possibly a DTensor shard of one)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return is_traceable_wrapper_subclass(local) and callable(getattr(local, "dequantize", None))


def read_state(local: Tensor, dtype: torch.dtype) -> Tensor:
    """A local state's values as a plain ``dtype`` tensor: the state itself when it already is one (no copy)."""
    if is_quantized(local):
        return local.dequantize(dtype)
    return local.to(dtype)


def dequantized(value: Tensor) -> Tensor:
    """A plain float32 tensor (or DTensor with the same layout) holding a quantized state's values."""
    if not isinstance(value, DTensor):
        return value.dequantize(torch.float32)
    local = value.to_local().dequantize(torch.float32)
    return DTensor.from_local(
        local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


def keep_bfloat16_on_load(optimizer: torch.optim.Optimizer, keys: tuple[str, ...]) -> None:
    """Keep ``keys`` of every parameter's state in bfloat16 across ``optimizer.load_state_dict``.

    torch's ``load_state_dict`` casts floating-point state to the parameter's dtype; bfloat16 values widen and
    narrow back exactly, so a resumed run continues bit for bit.
    """

    def narrow(optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for key in keys:
                value = state.get(key)
                if isinstance(value, Tensor) and value.dtype in (torch.float32, torch.float64):
                    state[key] = value.to(torch.bfloat16)

    optimizer.register_load_state_dict_post_hook(narrow)
