"""Pre-train Llama 3 from a TOML job config: ``torchrun ... train.py --job.config_file X.toml [--section.key value]``.

Reads top to bottom like the training recipe: config checked (preflight), the job built (device mesh, model on
meta, parallelize, initialise, optimizers, schedulers, data, checkpoint: ``torchtitan/training/job.py``, shared
with the optimizer x layout matrix), resume, loop. One step of the loop (micro-batches, forward, loss, backward,
clip, divergence guard, update, schedule) is ``Job.step``; its core, ``torchtitan/training/step.py``, is shared
with the memory estimator.
``python train.py ...`` without torchrun runs as one process.
"""

from __future__ import annotations

import json
import os
import sys
import time

from torchtitan.distributed.cuda_allocator import allocator_environ, allocator_setting

# Before torch is imported: the CUDA allocator reads its settings once, at its first allocation.
os.environ.update(allocator_environ(os.environ))

import torch.distributed as dist

from torchtitan.checkpoint.folders import FolderInUse
from torchtitan.config.job_config import JOB_CONFIG_RECORD, JobConfig
from torchtitan.config.preflight import checked_by_launcher, preflight
from torchtitan.datasets.build import DATASET_RECORD
from torchtitan.distributed.collectives import all_reduce_scalar, training_timeouts
from torchtitan.distributed.utils import init_distributed, set_float32_matmul_precision
from torchtitan.errors import exit_code, write_exit_record
from torchtitan.logging import init_logger, logger
from torchtitan.telemetry.health import format_health_line
from torchtitan.telemetry.metrics import (
    build_metric_logger,
    format_log_line,
    format_validation_line,
    memory_metrics,
    model_flops_per_token,
    peak_flops,
    reset_peak_memory,
    run_header,
)
from torchtitan.telemetry.profiling import maybe_profile
from torchtitan.training.garbage_collection import GarbageCollection
from torchtitan.training.job import build_job
from torchtitan.training.preemption import Preemption


def main(job_config: JobConfig) -> None:
    init_logger()
    if job_config.comm.trace_buf_size is not None:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(job_config.comm.trace_buf_size))
    # The job checked before any process group, compile or run folder, by the first rank, with the layout check unless
    # the launcher already ran it on this very job. The other ranks wait for it at the rendezvous (torchrun ends them
    # when it refuses the job, so a mistake is its one line) and check the rest after it.
    first_rank = int(os.environ.get("RANK", "0")) == 0
    if first_rank:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        checked = preflight(job_config, world_size, check_layout=not checked_by_launcher(world_size, sys.argv[1:]))
    device, rank, world_size = init_distributed(job_config.comm.init_timeout_seconds)
    if not first_rank:
        checked = preflight(job_config, world_size, check_layout=False)
    t = job_config.training
    logger.info(f"job: {job_config.job.description} | {world_size} process(es) on {device.type}")
    if device.type == "cuda":
        logger.info(f"memory: {allocator_setting(os.environ)}")
        precision = set_float32_matmul_precision(t.tf32, device)
        logger.info(f"float32 matmuls: {'TF32' if precision == 'high' else 'full float32'} (training.tf32 {t.tf32})")
    if job_config.job.print_args:
        logger.info(f"config: {job_config.to_dict()}")
    job = build_job(job_config, checked, device, world_size)
    model, optimizers, checkpoint, train_state = job.model, job.optimizers, job.checkpoint, job.train_state
    world_mesh, dp_group, dp_degree, validator = job.world_mesh, job.dp_group, job.dp_degree, job.validator
    if job_config.checkpoint.create_seed_checkpoint:
        seed_folder = checkpoint.create_seed_checkpoint()
        checkpoint.close()
        logger.info(f"seed checkpoint written to {seed_folder}; a run with this checkpoint.folder starts from it")
        return
    checkpoint.load(step=job_config.checkpoint.load_step)

    metric_logger = build_metric_logger(
        job_config,
        optimizers.name,
        rank,
        _world_group(),
        checkpoint.folder if checkpoint.enabled else None,
        resumed=train_state.step > 0,
        resumed_step=train_state.step,
    )
    if rank == 0:  # what the run read and the whole config it ran with, beside its metrics
        metric_logger.write_record(DATASET_RECORD, json.dumps(job.data_record, indent=1))
        metric_logger.write_record(JOB_CONFIG_RECORD, job_config.to_toml(run_header(world_size, device)))
    optimizers.initialise_state()  # a fresh run's state exists from the start (measured, and checkpointable)
    state_bytes = all_reduce_scalar(optimizers.state_bytes(), "sum", _world_group(), device)
    metric_logger.log({"optimizer/state_bytes": state_bytes}, train_state.step)
    logger.info(f"optimizer: {optimizers.name}, state {state_bytes / 2**20:,.1f} MiB over all ranks")

    tokens_per_step = job.tokens_per_step
    flops = model_flops_per_token(sum(p.numel() for p in model.parameters()), job.model_args, t.seq_len)
    gpu_peak = peak_flops(device)
    # SIGTERM or SIGUSR1: finish the step, save it, exit (torchtitan/training/preemption.py); the guard's all-reduce
    # tells every rank.
    preemption = Preemption()
    guard, health, timer, spikes = job.guard, job.health, job.timer, job.spikes
    guard.stop_signal = preemption.signalled
    logger.info(
        f"training {t.steps} steps from step {train_state.step}: global batch {t.batch_size * dp_degree} x "
        f"{t.gradient_accumulation_steps} accumulation x {t.seq_len} tokens"
    )
    if validator is not None and 0 < train_state.step < t.steps and train_state.validation_pending:
        # Resumed at a step whose validation was due: a run stopped on a signal saved it without validating.
        validate(validator, model, train_state.step, metric_logger)
        train_state.validation_pending = False
    window_start, window_steps = time.perf_counter(), 0
    first_step = train_state.step + 1
    with maybe_profile(job_config, train_state) as profiler, GarbageCollection(t.gc_freq) as garbage_collection:
        while train_state.step < t.steps:
            garbage_collection.run(train_state.step + 1)
            # One step of the loop (torchtitan/training/job.py): a skipped step still consumes its batches and
            # advances the schedule (see torchtitan/training/guard.py).
            outcome = job.step()
            loss, grad_norm, updated, lr = outcome.loss, outcome.grad_norm, outcome.updated, outcome.lr
            if health is not None and (health_metrics := health.metrics(lr)):
                logger.info(format_health_line(train_state.step, health_metrics))
                metric_logger.log(health_metrics, train_state.step)
            if train_state.step == first_step and world_size > 1:
                seconds = training_timeouts(job_config.comm, world_mesh, dp_group)
                logger.info(f"collectives: timeout {seconds} s from now on")
            window_steps += 1

            if train_state.step % job_config.metrics.log_freq == 0 or train_state.step == t.steps:
                elapsed = time.perf_counter() - window_start
                tps = tokens_per_step * window_steps / elapsed / max(1, world_size)
                metrics = {
                    "loss_metrics/global_avg_loss": all_reduce_scalar(loss, "mean", dp_group, device),
                    "loss_metrics/global_max_loss": all_reduce_scalar(loss, "max", dp_group, device),
                    "grad_norm": float(grad_norm),
                    "lr": lr,
                    "throughput/tps": tps,
                    "throughput/tokens_seen": float(train_state.tokens_seen),
                    "skipped_steps": float(train_state.skipped_steps),
                    **memory_metrics(device),
                    **timer.metrics(),
                    **(spikes.metrics() if spikes is not None else {}),
                }
                if gpu_peak is not None:
                    metrics["mfu(%)"] = 100 * tps * flops / gpu_peak
                logger.info(format_log_line(train_state.step, metrics, job_config.metrics.enable_color_printing))
                metric_logger.log(metrics, train_state.step)
                reset_peak_memory(device)
                window_start, window_steps = time.perf_counter(), 0

            if guard.stopped_at is not None:
                stop = guard.error(checkpoint.resume_hint())
                metric_logger.close()
                raise stop

            # Asked before a due validation: a stop saves this step at once (the resumed run validates it first).
            stop_now = train_state.step < t.steps and guard.stop_requested
            due = validator is not None and validator.due(train_state.step)
            train_state.validation_pending = due and stop_now  # saved with the step: its resumed run validates it
            if due and not stop_now:
                started = time.perf_counter()
                validate(validator, model, train_state.step, metric_logger)
                window_start += time.perf_counter() - started  # evaluation time is not training throughput

            if updated:  # never a checkpoint at a skipped step, the last one included
                with timer.part("checkpoint"):
                    checkpoint.save(train_state.step, force=train_state.step == t.steps)
            elif train_state.step == t.steps and checkpoint.enabled:
                logger.warning(f"the last step was skipped: no final checkpoint; {checkpoint.resume_hint()}")
            if profiler is not None:
                profiler.step()
            if stop_now:
                raise preemption.stop(checkpoint, train_state.step, updated, metric_logger)

    checkpoint.close()
    metric_logger.close()
    logger.info("training done")


def validate(validator, model, step: int, metric_logger) -> None:
    val_metrics, val_tokens = validator.run(model)
    logger.info(format_validation_line(step, val_metrics, val_tokens))
    metric_logger.log(val_metrics, step)


def _world_group():
    return dist.group.WORLD if dist.is_initialized() else None


def run() -> int:
    first_rank = int(os.environ.get("RANK", "0")) == 0
    folders: list[str] = []

    def body() -> None:
        job_config = JobConfig.parse_args()
        folders.append(job_config.job.dump_folder)
        try:
            main(job_config)
        except FolderInUse:
            folders.clear()  # that folder is the live run's: this run writes nothing into it, its record included
            raise

    def record(code: int, message: str) -> None:
        # torchrun reports any worker's failure as 1: the run's own ending is kept where a sweep reads it.
        if first_rank and folders:
            write_exit_record(folders[0], code, message)

    try:
        # Every rank raises the same error; the first one says it.
        return exit_code(body, print_errors=first_rank, on_exit=record)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run())
