"""A job built the one way it is trained, and one step of its loop: what ``train.py`` runs, and what the optimizer x
layout matrix (tests/optim/layout_matrix.py) runs, so that a test cannot drift from what users launch.

:func:`build_job` takes a job that ``preflight`` passed (its parallel degrees, model shape and tokenizer) and builds,
in the trainer's order: determinism, the device mesh, the model (TP, activation checkpointing, compile, FSDP2, HSDP
or DDP) and its initial weights, the optimizers, the lr schedulers, the data loader, the validator, the loss-spike
count, the loop's position, the checkpoint manager (not yet loaded), the divergence guard, optimizer health and
the step timer. :meth:`Job.step` is one step of the loop: the micro-batches of gradient accumulation, clipping,
the guard's decision, the update, the lr schedule, the loop's counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from torchtitan.checkpoint import CheckpointManager
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.build import build_data_loader, dataset_record
from torchtitan.distributed.collectives import first_step_timeouts
from torchtitan.distributed.utils import set_determinism
from torchtitan.logging import logger
from torchtitan.optim import build_optimizers
from torchtitan.telemetry.health import LossSpikes, OptimizerHealth
from torchtitan.telemetry.step_timing import StepTimer
from torchtitan.training.guard import DivergenceGuard
from torchtitan.training.lr_scheduling import build_lr_schedulers
from torchtitan.training.step import TrainState, build_model, first_compile_notice, init_model, train_step
from torchtitan.training.validate import build_validator, training_split


@dataclass
class StepOutcome:
    """What one step of the loop did: this rank's loss (summed over the micro-batches), the global gradient norm
    before clipping, whether the update was applied (the guard skips a non-finite one), the lr it stepped with."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    updated: bool
    lr: float


@dataclass
class Job:
    """Everything a run trains with, built by :func:`build_job`."""

    job_config: JobConfig
    device: torch.device
    parallel_dims: Any
    model_args: Any
    tokenizer: Any
    world_mesh: Any
    dp_rank: int
    dp_degree: int
    dp_group: Optional[dist.ProcessGroup]
    model: torch.nn.Module
    optimizers: Any
    lr_schedulers: Any
    data_record: dict
    data_loader: Any
    validator: Any
    spikes: Optional[LossSpikes]
    train_state: TrainState
    checkpoint: CheckpointManager
    guard: DivergenceGuard
    health: Optional[OptimizerHealth]
    timer: StepTimer
    _batches: Any = None

    @property
    def tokens_per_step(self) -> int:
        t = self.job_config.training
        return t.batch_size * t.seq_len * t.gradient_accumulation_steps * self.dp_degree

    def step(self) -> StepOutcome:
        """The loop's next step: ``train_step`` on this rank's next micro-batches, then the schedule and counters (a
        step the guard skipped still consumes its batches and advances the schedule; see training/guard.py)."""
        if self._batches is None:  # from the loader's position: a resumed run reads on from its checkpoint's
            self._batches = iter(self.data_loader)
        state = self.train_state
        state.step += 1
        lr = self.lr_schedulers.get_last_lr()
        loss, grad_norm, updated = train_step(
            self.model,
            self.optimizers,
            self._batches,
            self.parallel_dims,
            self.job_config,
            self.device,
            self.guard,
            state.step,
            self.health,
            self.timer,
        )
        self.timer.step_done()
        if self.spikes is not None:
            self.spikes.record(loss, updated)
        self.lr_schedulers.step()
        state.tokens_seen += self.tokens_per_step
        state.skipped_steps += not updated
        return StepOutcome(loss, grad_norm, updated, lr)


def build_job(job_config: JobConfig, checked: tuple, device: torch.device, world_size: int) -> Job:
    """The job ``preflight`` passed (``checked``: its parallel dims, model args and tokenizer), built on ``device``
    in a process group of ``world_size`` ranks (or none, for one process), in train.py's order."""
    parallel_dims, model_args, tokenizer = checked
    t = job_config.training
    set_determinism(t.seed, t.deterministic)

    world_mesh = parallel_dims.build_mesh(device.type)
    dp_rank, dp_degree = parallel_dims.dp_rank_and_degree(world_mesh)
    dp_group = parallel_dims.dp_mesh(world_mesh).get_group() if parallel_dims.dp_enabled else None
    if world_size > 1:  # compiling comes next, on some ranks from a warm cache and on others cold
        seconds = first_step_timeouts(job_config.comm, world_mesh, dp_group)
        logger.info(f"collectives: timeout {seconds} s until the first step ends")

    model = build_model(job_config, model_args, parallel_dims, world_mesh, compute_device_type=device.type)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        f"model: llama3 {job_config.model.flavor}, {num_params:,} parameters, vocab {model_args.vocab_size}, "
        f"{t.param_dtype} weights"
    )
    init_model(model, device, t.seed)

    optimizers = build_optimizers([model], job_config)
    torch_optimizer = all(type(o).__module__.startswith("torch.optim.") for o in optimizers.optimizers)
    if (notice := first_compile_notice(job_config, device.type, torch_optimizer)) is not None:
        logger.info(notice)  # its state is created (compiling its step) by the first load or save, or by the run
    lr_schedulers = build_lr_schedulers(optimizers, job_config)
    data_record = dataset_record(job_config, tokenizer)
    logger.info(f"data: {data_record['source']}, fingerprint {data_record['fingerprint']}")
    world_group = dist.group.WORLD if dist.is_initialized() else None
    data_loader = build_data_loader(
        job_config,
        tokenizer,
        dp_rank,
        dp_degree,
        data_record["fingerprint"],
        training_split(job_config),
        pin_memory=device.type == "cuda",
        group=world_group,
    )
    validator = build_validator(job_config, tokenizer, parallel_dims, dp_rank, dp_degree, dp_group, device)
    spikes = LossSpikes.build(job_config, device, dp_group)
    train_state = TrainState(spikes)  # a resumed run counts loss spikes on from its checkpoint's count
    checkpoint = CheckpointManager(
        data_loader=data_loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        job_config=job_config,
        token_ids={"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id},
    )
    return Job(
        job_config=job_config,
        device=device,
        parallel_dims=parallel_dims,
        model_args=model_args,
        tokenizer=tokenizer,
        world_mesh=world_mesh,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        dp_group=dp_group,
        model=model,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        data_record=data_record,
        data_loader=data_loader,
        validator=validator,
        spikes=spikes,
        train_state=train_state,
        checkpoint=checkpoint,
        # train.py hands it the preemption handler's signal (Preemption is installed just before the loop).
        guard=DivergenceGuard(t.max_skipped_steps, device),
        health=OptimizerHealth.build([model], job_config, device),
        timer=StepTimer(device),
    )
