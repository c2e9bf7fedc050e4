"""How an optimizer's per-element state is stored: float32, bfloat16, or 8-/4-bit block-quantized (torchao).

Storage is a property of the state tensor, not of the update: an update reads a state as a plain tensor of the
compute dtype (``read_state``), does its math there, and writes the result back (``write_state``), which rounds to
the storage (stochastic rounding for bfloat16; blockwise quantization for the torchao tensors). "float32" state is
float32 whatever the weights' dtype (float64 for float64 weights). The quantized tensors are
torchao's ``OptimState8bit`` / ``OptimState4bit`` (the ones its AdamW8bit/AdamW4bit keep), wrapped in a DTensor
exactly when the parameter is one.

Whether a state is quantized, and into which blocks, is decided on the whole parameter (``quantized_layout``), never on
a rank's shard: the same parameter has the same state format, the same bytes and the same values in every layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan.distributed.utils import local_tensor, split_dim
from torchtitan.errors import UserError

FLOAT32, BFLOAT16, INT8, INT4 = "float32", "bfloat16", "int8", "int4"
STATE_DTYPES = (FLOAT32, BFLOAT16)  # what [optimizer] state_dtype offers
DEFAULT_BLOCK_SIZE = {INT8: 256, INT4: 128}  # torchao's defaults for its 8- and 4-bit moments
# Like torchao (after bitsandbytes): tensors smaller than this keep float32 state even when quantized is asked for.
MIN_QUANTIZED_NUMEL = 4096


def quantized_layout(param: Tensor, block_size: int) -> bool:
    """Whether ``param``'s state is quantized in blocks of ``block_size``, judged on the whole parameter.

    A quantized state is cut into blocks of ``block_size`` consecutive values along the last dimension, so the
    parameter needs at least two dimensions, ``MIN_QUANTIZED_NUMEL`` values and a last dimension that is a whole
    number of blocks. Such blocks never straddle two shards of a split along any other dimension (FSDP's rows, even
    uneven ones), so every layout holds the same blocks. A split of the last dimension itself (tensor parallelism)
    must cut it into whole blocks too: otherwise the state would differ from the unsplit one, which is refused.
    """
    shape = param.shape
    if len(shape) < 2 or param.numel() < MIN_QUANTIZED_NUMEL or shape[-1] % block_size:
        return False
    if isinstance(param, DTensor):
        extent = shape[-1]
        for mesh_dim, placement in enumerate(param.placements):
            if split_dim(placement) in (len(shape) - 1, -1):
                parts = param.device_mesh.size(mesh_dim)
                extent = -(-extent // parts)  # the largest part; the others are whole blocks when it is
                if extent % block_size:
                    raise UserError(
                        f"the quantized optimizer state of a {tuple(shape)} parameter is kept in blocks of "
                        f"{block_size} along its last dimension, which the layout splits into parts of up to "
                        f"{extent}; choose a tensor parallel degree that cuts {shape[-1]} into multiples of "
                        f"{block_size}, or an --optimizer.block_size that divides {extent}"
                    )
    return True


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """What "float32" state means: float32 whatever the weights' dtype, float64 for float64 weights (the reference
    precision of our tests)."""
    return torch.promote_types(dtype, torch.float32)


def new_state(param: Tensor, storage: str, block_size: int | None = None, signed: bool = True) -> Tensor:
    """Zeros shaped like ``param`` (a DTensor with its layout when ``param`` is one), stored as ``storage``."""
    local = local_tensor(param)
    if storage in (INT8, INT4):
        out = _quantized_zeros(param, storage, block_size or DEFAULT_BLOCK_SIZE[storage], signed)
    elif storage == BFLOAT16:
        out = torch.zeros_like(local, dtype=torch.bfloat16, memory_format=torch.preserve_format)
    elif storage == FLOAT32:
        out = torch.zeros_like(local, dtype=at_least_float32(local.dtype), memory_format=torch.preserve_format)
    else:
        raise ValueError(f"unknown state storage {storage!r}")
    return laid_out_like(param, out)


def laid_out_like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (this rank's state of ``param``) as a DTensor with ``param``'s layout, or as it is for a plain
    ``param``."""
    if not isinstance(param, DTensor):
        return local
    # Local shards may differ in shape between ranks (uneven first dimension): give the global shape explicitly.
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _quantized_zeros(param: Tensor, storage: str, block_size: int, signed: bool) -> Tensor:
    local = local_tensor(param)
    if not quantized_layout(param, block_size):
        return torch.zeros_like(local, dtype=at_least_float32(local.dtype))
    from torchtitan.optim.state.torchao_import import import_torchao_optim

    import_torchao_optim()  # a clear error when torchao is missing
    if storage == INT8:
        from torchao.optim.subclass_8bit import OptimState8bit as cls
    else:
        from torchao.optim.subclass_4bit import OptimState4bit as cls
    return cls.zeros(local.shape, signed=signed, block_size=block_size, device=local.device)


def is_quantized(value: Any) -> bool:
    """A torchao quantized state tensor (possibly a DTensor shard of one)."""
    local = local_tensor(value)
    return is_traceable_wrapper_subclass(local) and callable(getattr(local, "dequantize", None))


def block_scales(value: Tensor) -> Tensor:
    """A quantized state's block scales, shaped like the state with its last dimension counted in blocks.

    A view of the live scales (a DTensor laid out like ``value`` when it is one). With the blocks that
    :func:`quantized_layout` chooses, this tensor is the same in every layout, so it reshards like the state.
    """
    local = local_tensor(value)
    scales = local.scale.view(_block_grid(local.shape, local.block_size))
    if not isinstance(value, DTensor):
        return scales
    shape = torch.Size(_block_grid(value.shape, local.block_size))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(scales, value.device_mesh, value.placements, run_check=False, shape=shape, stride=stride)


def _block_grid(shape: torch.Size, block_size: int) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] // block_size)


def quantize_with_scales(stored: Tensor, values: Tensor, scales: Tensor) -> None:
    """Quantize ``values`` into the local quantized state ``stored``, block by block with the given ``scales``.

    Quantizing divides each block by its scale and stores the nearest code. torchao takes a block's largest
    magnitude as its scale, but the signed code tables end above -1 (-0.993 for 8-bit, -0.8875 for 4-bit): values
    read back from a block whose largest magnitude is negative have a smaller maximum, and quantizing them again
    would shrink that block. With the block's own scale instead, each value ``code * scale`` divides back to its
    code (within float32 rounding, far less than the gap to the next code), so the codes and scales come back bit
    for bit.
    """
    from torchao.optim import quant_utils
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    blocks = values.reshape(-1, stored.block_size)
    block_scales = scales.reshape(-1, 1).to(values.dtype)
    # The code search holds about 45 bytes of temporaries per value (int64 indices, gathered codes): a sixteenth of
    # the blocks at a time keeps them under the tensor's own float32 size, which a load holds anyway.
    per_slice = max(1, -(-blocks.shape[0] // _QUANTIZE_SLICES))
    packed = isinstance(stored, OptimState4bit)
    if blocks.shape[0] == 0:  # a rank without a share of this parameter
        return
    codes_out = stored.codes.view(-1).view(blocks.shape[0], -1)  # each block's codes (4-bit: two a byte)
    for start in range(0, blocks.shape[0], per_slice):
        rows = slice(start, start + per_slice)
        scaled = blocks[rows] / block_scales[rows]
        if isinstance(stored, OptimState8bit):
            codes = quant_utils.quantize_8bit_with_qmap(scaled, stored.qmap)
        elif packed:
            unpacked = quant_utils.quantize_4bit_with_qmap(scaled.reshape(-1), stored.qmap)
            codes = (unpacked[::2] << 4) | unpacked[1::2]  # two codes a byte, as torchao packs them
        else:  # torchao's float8 state: the code is the scaled value in float8
            codes = scaled.to(stored.codes.dtype)
        codes_out[rows].copy_(codes.reshape(codes_out[rows].shape))
    stored.scale.copy_(scales.reshape(-1))


_QUANTIZE_SLICES = 16


def write_state(stored: Tensor, value: Tensor, step: Tensor) -> None:
    """Store ``value`` into the local state ``stored``: bfloat16 rounds stochastically (``step`` salts the rounding,
    see :func:`round_to_bfloat16_stochastically`), quantized state quantizes, float state copies."""
    if stored.dtype == torch.bfloat16 and value.dtype != torch.bfloat16:
        value = round_to_bfloat16_stochastically(value, step)
    stored.copy_(value)


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


_LOW_32_BITS = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A well-mixed 32-bit hash of int64 ``x`` (values below 2**32); multipliers under 2**31 keep products in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW_32_BITS
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _LOW_32_BITS
    return x ^ (x >> 16)


def round_to_bfloat16_stochastically(value: Tensor, salt: Tensor) -> Tensor:
    """``value`` rounded to bfloat16, up or down with odds by distance, so that the rounding is unbiased.

    Round-to-nearest loses any change below half a bfloat16 step (1/512 of the value): ``v * 0.999`` rounds back
    to ``v``, so a slowly decaying moment never decays. Stochastic rounding keeps such changes on average. The
    random bits are a hash of the value's float32 bits and ``salt`` (an int64 tensor that changes every step, e.g.
    the step count): no generator state, so a resumed run and every world size round exactly alike.
    """
    bits = value.to(torch.float32).view(torch.int32)
    unsigned = bits.to(torch.int64) & _LOW_32_BITS
    noise = _hash32(unsigned ^ _hash32(salt.to(torch.int64) & _LOW_32_BITS)) & 0xFFFF
    # Adding up to one bfloat16 step to the bits, then dropping the 16 low bits, rounds the magnitude up with
    # probability (dropped bits) / 2**16.
    return ((bits + noise.to(torch.int32)) & -65536).view(torch.float32).to(torch.bfloat16)


def keep_state_dtypes_on_load(optimizer: torch.optim.Optimizer, storages: dict[str, str]) -> None:
    """Keep the state ``{key: storage}`` (FLOAT32 or BFLOAT16) in its own dtype across ``load_state_dict``.

    torch's ``load_state_dict`` casts floating-point state to the parameter's dtype: float32 state of bfloat16
    weights would come back rounded to bfloat16. The incoming tensors are kept aside before that cast and put back in
    the storage's dtype after it (bfloat16 values pass through float32 exactly), so a resumed run continues bit for
    bit.
    """
    incoming: dict[Tensor, dict[str, Tensor]] = {}

    def keep_incoming(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        incoming.clear()
        for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups):
            for index, param in zip(saved_group["params"], group["params"]):
                saved = state_dict["state"].get(index, {})
                incoming[param] = {key: saved[key] for key in storages if isinstance(saved.get(key), Tensor)}

    def restore_dtypes(optimizer: torch.optim.Optimizer) -> None:
        for param, values in incoming.items():
            state = optimizer.state[param]
            for key, value in values.items():
                dtype = torch.bfloat16 if storages[key] == BFLOAT16 else at_least_float32(param.dtype)
                state[key] = value.to(dtype=dtype, device=state[key].device)
        incoming.clear()

    optimizer.register_load_state_dict_pre_hook(keep_incoming)
    optimizer.register_load_state_dict_post_hook(restore_dtypes)
