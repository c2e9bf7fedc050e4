"""How a Llama 3 model is spread over the device mesh: float8 linears, tensor parallelism, activation
checkpointing, compile and FSDP2, applied in that order to a model still on the meta device.

The order matters: float8 swaps ``nn.Linear`` modules, which the tensor-parallel plan must then see; checkpoint
and compile wrappers go around whole blocks; FSDP2 goes last, around the (wrapped) blocks and the root, so that its
all-gathers run outside compiled and recomputed regions.

With one process and no parallelism (``world_mesh is None``) only float8, activation checkpointing, compile and (on
CUDA) autocast are applied. On CUDA the model computes in ``training.mixed_precision_param`` over float32 master
weights whatever the layout (:func:`mixed_precision_mode`): through FSDP2's policy (fp32 gradient reduction) when
data parallelism is on, else through autocast around the model's forward (one GPU, TP only). On CPU it computes in
its parameters' dtype.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import DTYPES
from torchtitan.errors import UserError
from torchtitan.models.llama import ModelArgs, Transformer
from torchtitan.parallelisms.activation_checkpoint import apply_activation_checkpointing
from torchtitan.parallelisms.parallel_dims import ParallelDims

# Float8 needs hardware float8 matmuls (Ada / Hopper and newer).
_FLOAT8_MIN_CAPABILITY = (8, 9)


def parallelize_llama(
    model: Transformer,
    world_mesh: Optional[DeviceMesh],
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    *,
    compute_device_type: Optional[str] = None,
    tensor_device_type: Optional[str] = None,
) -> Transformer:
    """Apply float8, TP, activation checkpointing, compile, and FSDP2 or autocast to ``model`` in place; returns it.

    ``compute_device_type`` (default: the mesh's, else "cpu") decides the mixed precision; ``tensor_device_type``
    (default: the same) is where the model's tensors will live. The memory estimator plans a GPU job ("cuda") on
    CPU fake tensors ("cpu").
    """
    validate_model_for_parallelism(model.args, parallel_dims)
    if job_config.float8.enable_float8_linear:
        convert_to_float8(model)
    if parallel_dims.tp_enabled:
        apply_tensor_parallel(
            model,
            world_mesh["tp"],
            loss_parallel=_loss_parallel_on(parallel_dims, job_config),
            float8=job_config.float8.enable_float8_linear,
        )
    apply_activation_checkpointing(model, job_config.activation_checkpoint)
    if job_config.training.compile:
        apply_compile(model)
    device_type = compute_device_type or (world_mesh.device_type if world_mesh is not None else "cpu")
    mode = mixed_precision_mode(parallel_dims, job_config, device_type)
    if parallel_dims.dp_enabled:
        policy = _fsdp_policy(job_config) if mode == "fsdp" else MixedPrecisionPolicy()
        apply_fsdp(model, parallel_dims.fsdp_mesh(world_mesh), policy)
    elif mode == "autocast":
        apply_autocast(model, tensor_device_type or device_type, DTYPES[job_config.training.mixed_precision_param])
    return model


def mixed_precision_mode(parallel_dims: ParallelDims, job_config: JobConfig, compute_device_type: str) -> Optional[str]:
    """How the model computes in ``training.mixed_precision_param`` on its device: "fsdp" (FSDP2's policy, with
    data parallelism), "autocast" (one device or TP only, when that dtype is narrower than the parameters'), or
    None (CPU, or nothing to narrow: the model computes in its parameters' dtype)."""
    t = job_config.training
    if compute_device_type != "cuda":
        return None
    if parallel_dims.dp_enabled:
        return "fsdp"
    narrower = DTYPES[t.mixed_precision_param].itemsize < DTYPES[t.param_dtype].itemsize
    return "autocast" if narrower else None


def validate_model_for_parallelism(model_args: ModelArgs, parallel_dims: ParallelDims) -> None:
    """Raise UserError when the model's shapes cannot be split by the tensor-parallel degree."""
    tp = parallel_dims.tp
    if tp == 1:
        return
    shapes = {
        "model n_heads": model_args.n_heads,
        "model n_kv_heads": model_args.kv_heads,
        "model feed-forward hidden size": model_args.ffn_hidden_dim,
        # Sequence parallelism splits every sequence evenly between the tensor-parallel ranks.
        "training.seq_len (model max_seq_len)": model_args.max_seq_len,
    }
    for what, size in shapes.items():
        if size % tp:
            raise UserError(
                f"training.tensor_parallel_degree {tp} does not divide the {what} {size}; pick a degree that divides it"
            )


def loss_parallel_context(
    parallel_dims: ParallelDims, job_config: Optional[JobConfig] = None
) -> AbstractContextManager:
    """Wrap the loss and its backward: cross-entropy over vocabulary-sharded logits, without gathering them."""
    return loss_parallel() if _loss_parallel_on(parallel_dims, job_config) else nullcontext()


def _loss_parallel_on(parallel_dims: ParallelDims, job_config: Optional[JobConfig]) -> bool:
    disabled = job_config is not None and job_config.training.disable_loss_parallel
    return parallel_dims.loss_parallel_enabled and not disabled


# ----------------------------------------------------------------------------------------------------------------
# Float8


def check_float8_supported() -> None:
    if not torch.cuda.is_available():
        raise UserError("float8.enable_float8_linear needs a CUDA GPU with compute capability >= 8.9; none found")
    capability = torch.cuda.get_device_capability()
    if capability < _FLOAT8_MIN_CAPABILITY:
        raise UserError(
            f"float8.enable_float8_linear needs a GPU with compute capability >= 8.9; this one has "
            f"{capability[0]}.{capability[1]} (turn float8 off)"
        )


def convert_to_float8(model: nn.Module) -> None:
    """Swap every linear except the output projection for torchao's float8 training linear."""
    check_float8_supported()
    from torchao.float8 import convert_to_float8_training  # imported here: torchao is slow and noisy to import

    # The output projection stays in high precision: its logits feed the loss directly and it is sensitive.
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "output")


# ----------------------------------------------------------------------------------------------------------------
# Tensor parallelism


def _tp_styles(float8: bool):
    """Column-wise, row-wise and input-preparing styles; float8 linears need torchao's float8-aware ones."""
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def apply_tensor_parallel(
    model: Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, float8: bool = False
) -> None:
    """Megatron-style TP with sequence parallelism: the residual stream between blocks is split along the sequence.

    Every parameter becomes a DTensor on the tp mesh (norms are replicated ones through SequenceParallel), so that
    foreach optimizers and gradient clipping never mix DTensors with plain tensors.
    """
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                # Loss parallel keeps the logits sharded over the vocabulary as a DTensor; otherwise gather them.
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    if model.args.enable_weight_tying:
        # Each style distributed its own copy; both shard the vocabulary rows (Shard(0)), so one serves both.
        model.output.weight = model.tok_embeddings.weight
    model.loss_parallel = loss_parallel
    colwise, rowwise, prepare_input = _tp_styles(float8)
    block_plan = {
        "attention_norm": SequenceParallel(),
        # The rotary table (second argument) is a plain buffer every rank holds whole.
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


# ----------------------------------------------------------------------------------------------------------------
# Compile and FSDP2


def apply_compile(model: Transformer) -> None:
    """Compile each block on its own: blocks share code, so one compilation serves them all."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True))


def _fsdp_policy(job_config: JobConfig) -> MixedPrecisionPolicy:
    """Compute in ``mixed_precision_param`` (parameters gathered in it), reduce gradients in ``..._reduce``.

    Forward inputs are not cast: a block's second input is the float32 rotary table, which FSDP2 would otherwise
    round to bfloat16 for every block (the one-GPU autocast path keeps it float32). The residual stream needs no
    cast either: it leaves the embedding, whose weight is gathered in the compute dtype, already in it.
    """
    training = job_config.training
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[training.mixed_precision_param],
        reduce_dtype=DTYPES[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )


def apply_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under autocast to ``dtype``: matmuls compute in it from float32 master weights,
    whose gradients stay float32. The loss is part of the forward: cross-entropy runs in float32 (at least), and
    the chunked loss computes its projection in ``dtype`` (``torchtitan.training.loss``). Backward runs outside
    autocast, as torch recommends; state-dict names are untouched (the forward is wrapped, not the module)."""
    forward = model.forward

    @functools.wraps(forward)
    def forward_under_autocast(*args, **kwargs):
        # No weight-cast cache: it would keep a low-precision copy of every weight until the forward ends, which
        # activation checkpointing would otherwise free block by block (each weight is cast once per forward anyway).
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            return forward(*args, **kwargs)

    model.forward = forward_under_autocast


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """Shard each block and the root (embedding, final norm, output) over ``dp_mesh`` (2-D mesh: HSDP)."""
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        last = index == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=not last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
