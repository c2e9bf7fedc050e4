"""Optional torch profiler traces and CUDA memory snapshots, every ``profiling.profile_freq`` steps."""

from __future__ import annotations

import contextlib
import os
import pickle

import torch

from torchtitan.logging import logger


@contextlib.contextmanager
def maybe_profile(job_config, train_state):
    """Yields a profiler to ``step()`` once per training step, or None when profiling is off."""
    cfg = job_config.profiling
    if not cfg.enable_profiling and not cfg.enable_memory_snapshot:
        yield None
        return
    rank = int(os.environ.get("RANK", "0"))
    trace_dir = os.path.join(job_config.job.dump_folder, cfg.save_traces_folder)
    snapshot_dir = os.path.join(job_config.job.dump_folder, cfg.save_memory_snapshot_folder)
    cuda = torch.cuda.is_available()
    if cfg.enable_memory_snapshot and cuda:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    elif cfg.enable_memory_snapshot:
        logger.warning("profiling.enable_memory_snapshot needs a CUDA device; no snapshots on this machine")

    def on_trace_ready(prof) -> None:
        if cfg.enable_profiling:
            folder = os.path.join(trace_dir, f"step{train_state.step}")
            os.makedirs(folder, exist_ok=True)
            prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))
            logger.info(f"profiler trace written to {folder}")
        if cfg.enable_memory_snapshot and cuda:
            os.makedirs(snapshot_dir, exist_ok=True)
            path = os.path.join(snapshot_dir, f"step{train_state.step}_rank{rank}.pickle")
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    warmup = min(3, max(0, cfg.profile_freq - 2))
    schedule = torch.profiler.schedule(wait=cfg.profile_freq - warmup - 1, warmup=warmup, active=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready) as prof:
        yield prof
