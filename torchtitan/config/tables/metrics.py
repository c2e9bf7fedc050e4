"""[metrics] and [profiling]: what a run reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt

WANDB_INSTALL = "pip install -e '.[wandb]'"  # the optional extra that metrics.enable_wandb needs


@dataclass
class Metrics:
    log_freq: int = opt(10, "log and record metrics every N steps", gt=0)
    enable_tensorboard: bool = opt(True, "write TensorBoard event files")
    save_tb_folder: str = opt("tb", "TensorBoard folder inside job.dump_folder")
    rank_0_only: bool = opt(
        True, "only rank 0 writes TensorBoard and metrics.jsonl; false: every rank writes its own (subfolder rank_N)"
    )
    enable_color_printing: bool = opt(False, "colour the per-step log line (ANSI escape codes)")
    health_freq: int = opt(
        50,
        "every N steps, log optimizer health per weight group (gradient norm, update RMS, update/weight ratio, "
        "weight norm, largest attention logit) and count loss spikes (docs/telemetry.md); 0: off, at no cost",
        ge=0,
    )
    health_max_layers: int = opt(
        16, "health per layer for models of at most this many layers; deeper models: per weight role only", ge=0
    )
    health_snapshot_gib: float = opt(
        1.0,
        "host memory (GiB per rank) the health may hold for the weights before a measured step, to measure the update "
        "(update RMS, update/weight); a rank whose weights are larger logs no update metrics (docs/telemetry.md)",
        ge=0.0,
    )
    loss_spike_factor: float = opt(
        2.0, "a step's loss counts as a spike when above this factor times the running median loss", gt=1.0
    )
    loss_spike_window: int = opt(100, "steps in the running median that loss spikes are measured against", gt=0)
    enable_wandb: bool = opt(False, "also log to Weights & Biases (pip install -e '.[wandb]'), from global rank 0")
    wandb_project: str = opt("torchtitan", "Weights & Biases project")
    wandb_entity: Optional[str] = opt(None, "Weights & Biases entity (team or user); unset: your default entity")
    wandb_run_name: Optional[str] = opt(
        None, "Weights & Biases run name; unset: the run folder's name (in a study, the cell's run name)"
    )
    wandb_group: Optional[str] = opt(None, "Weights & Biases group; unset: none (in a study, the study's name)")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "write torch profiler traces")
    save_traces_folder: str = opt("profile_traces", "trace folder inside job.dump_folder")
    profile_freq: int = opt(10, "profile one step every N steps", gt=0)
    enable_memory_snapshot: bool = opt(False, "write CUDA memory snapshots (GPU only)")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder inside job.dump_folder")
