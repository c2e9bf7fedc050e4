"""Where a training step happens: the model a job trains, one optimizer step, and the loop's position.

``train.py`` and the memory estimator (``torchtitan.estimation``) both use these, so an estimate traces the very
step a run takes:

* :func:`build_model`: the job's Llama 3 on the meta device, in the parameter dtype, parallelized (TP, activation
  checkpointing, compile, FSDP2, or autocast for bf16 compute without FSDP); no memory yet.
* :func:`init_model`: memory on a device and the initial weights (the same for every layout and world size).
* :func:`train_step`: forward, loss, backward over the accumulation micro-batches (under HSDP, one all-reduce
  across replicas per step), gradient clipping, the divergence guard's decision, the optimizer step.
* :class:`TrainState`: the loop's position (step, tokens seen, skipped steps), saved with every checkpoint.
* :func:`first_compile_notice`: the line a run logs before its first compile, which is silent and long on a CPU.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import DTYPES, clip_grad_norm_
from torchtitan.models.llama import ModelArgs, Transformer
from torchtitan.parallelisms import ParallelDims, loss_parallel_context, parallelize_llama
from torchtitan.telemetry.health import LossSpikes, OptimizerHealth
from torchtitan.telemetry.step_timing import StepTimer
from torchtitan.training.guard import DivergenceGuard


class TrainState:
    """The loop's own position, saved with every checkpoint, and the loss-spike count of ``spikes`` (None when
    health is off), so that a resumed run counts on from its checkpoint's."""

    def __init__(self, spikes: Optional[LossSpikes] = None) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # steps whose update the divergence guard skipped
        # A validation due at this step that has not run: a run stopped on a signal saves before validating.
        self.validation_pending = False
        self.spikes = spikes

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "tokens_seen": self.tokens_seen}
        state["skipped_steps"] = self.skipped_steps
        state["validation_pending"] = self.validation_pending
        if self.spikes is not None:
            state["loss_spikes"] = self.spikes.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))  # absent from checkpoints of older versions
        self.validation_pending = bool(state.get("validation_pending", False))  # older ones validated before saving
        if self.spikes is not None and "loss_spikes" in state:  # absent from older ones, or from runs without health
            self.spikes.load_state_dict(state["loss_spikes"])


def build_model(
    job_config: JobConfig,
    model_args: ModelArgs,
    parallel_dims: ParallelDims,
    world_mesh: Optional[DeviceMesh],
    *,
    compute_device_type: Optional[str] = None,
    tensor_device_type: Optional[str] = None,
) -> Transformer:
    """The job's model on the meta device, in ``training.param_dtype``, parallelized over ``world_mesh``.

    ``compute_device_type`` (default: the mesh's) picks the mixed precision (FSDP2's policy or autocast), and
    ``tensor_device_type`` (default: the same) is where the tensors will live; see ``parallelize_llama``.
    """
    with torch.device("meta"):
        model = Transformer(model_args).to(DTYPES[job_config.training.param_dtype])
    return parallelize_llama(
        model,
        world_mesh,
        parallel_dims,
        job_config,
        compute_device_type=compute_device_type,
        tensor_device_type=tensor_device_type,
    )


def init_model(model: Transformer, device: torch.device, seed: int) -> Transformer:
    """Give a meta-device model its memory on ``device`` and its initial weights from ``seed``; training mode."""
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    model.train()
    return model


def first_compile_notice(job_config: JobConfig, device_type: str, torch_optimizer: bool = False) -> Optional[str]:
    """What the run compiles before and during its first step, and roughly how long that takes here; None when
    nothing compiles: ``TORCHDYNAMO_DISABLE=1``, or torch's own optimizer (``torch_optimizer``: AdamW and Adam with
    float32 state) on a model that compiles nothing (``training.compile`` off, norms other than compiled_rmsnorm).
    The optimizer's compiled step (Adam-mini's fused one, torchao's low-bit steps, bfloat16 state, AdEMAMix, Muon's
    bfloat16 Newton-Schulz) compiles when its state is created."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0"):
        return None
    parts = []
    if job_config.training.compile:
        parts.append("the model's blocks (training.compile)")
    elif job_config.model.norm_type == "compiled_rmsnorm":
        parts.append("the model's norms (compiled_rmsnorm)")
    if not torch_optimizer:
        parts.append("the optimizer's step if it has a compiled one")
    if not parts:
        return None
    if device_type == "cpu":
        # Measured on the debug model, 2 CPU cores, with an empty inductor cache: torchao's 4-bit AdamW at FSDP 2,
        # 23 s on an idle machine (December 2026); on a busy one, earlier, 1 to 2 minutes.
        how_long = "from seconds to a minute or two (a compiled optimizer step) on a 2-core CPU"
    else:
        how_long = "not yet timed on a GPU"
    return (
        f"compiling {' and '.join(parts)}: first step only, {how_long}; "
        "a warm inductor cache (the same machine and shapes) shortens it"
    )


def train_step(
    model: torch.nn.Module,
    optimizers,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    guard: DivergenceGuard | None = None,
    step: int = 0,
    health: OptimizerHealth | None = None,
    timer: StepTimer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns (local loss, grad norm,
    whether the update was applied). With a ``guard``, a non-finite loss or grad norm skips the update of ``step``.
    With ``health``, a step it is due at is measured (gradients after the last micro-batch, before clipping; the
    update around the optimizer step); ``timer`` times the step's parts."""
    t = job_config.training
    measuring = health is not None and health.start(step)
    optimizers.zero_grad()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for index in range(t.gradient_accumulation_steps):
        _all_reduce_across_replicas(model, parallel_dims, last=index == t.gradient_accumulation_steps - 1)
        with _part(timer, "data"):
            inputs, labels = next(batches)
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with _part(timer, "forward_backward"), loss_parallel_context(parallel_dims):
            if measuring:
                health.record_attention(model, inputs, labels, job_config.loss.num_chunks)
            loss = model(inputs, labels=labels, loss_chunks=job_config.loss.num_chunks) / t.gradient_accumulation_steps
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        total += loss.detach().to(torch.float64)
    with _part(timer, "optimizer"):
        if measuring:
            health.record_gradients()
        grad_norm = clip_grad_norm_(model.parameters(), t.max_norm)
        if guard is not None and not guard.should_update(total, grad_norm, step):
            if measuring:
                health.discard()
            return total, grad_norm, False
        if measuring:
            health.snapshot_weights()
        optimizers.step()
        if measuring:
            health.record_update()
    return total, grad_norm, True


def _part(timer: StepTimer | None, name: str):
    return timer.part(name) if timer is not None else nullcontext()


def _all_reduce_across_replicas(model: torch.nn.Module, parallel_dims: ParallelDims, last: bool) -> None:
    """HSDP: gradients are all-reduced across replicas once per step, with the last micro-batch's backward.

    Every micro-batch still reduce-scatters within its replica (gradients stay sharded, so memory stays low); FSDP2
    adds the earlier micro-batches' reduced shards into the last one before its all-reduce.
    """
    if parallel_dims.dp_replicate_enabled and isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last)
