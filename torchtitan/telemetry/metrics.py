"""Per-step numbers: a log line, TensorBoard scalars and a metrics.jsonl beside them (rank 0 only), and with
``metrics.enable_wandb`` the same scalars in Weights & Biases (global rank 0 only).

Run directories are ``{job.dump_folder}/{metrics.save_tb_folder}/{timestamp}_{optimizer}``, so runs of the same
config with different optimizers overlay in one TensorBoard. A W&B run is named after its run directory (or
``metrics.wandb_run_name``), records the resolved job config, and writes its own files (offline runs included)
under ``wandb/`` in the run directory. With checkpointing on, its id and last logged step are kept beside the
checkpoint folder, so that a run resumed from a checkpoint continues the same W&B run, or, resumed from a step older
than the one it logged last (or offline), starts a new run in the same group, linked to it (``wandb_continuation``).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import sys
import time
from typing import Any, Optional

import torch

from torchtitan.distributed.collectives import all_gather_objects
from torchtitan.errors import UserError
from torchtitan.files import write_text_atomically
from torchtitan.logging import logger

# Dense bf16 peak FLOP/s per device, for MFU, as (part of torch.cuda.get_device_name, FLOP/s): the first match
# wins, so a variant comes before its family ("NVIDIA H100 PCIe" and "NVIDIA H100 NVL" before "NVIDIA H100 80GB
# HBM3", the SXM part). Datasheet figures without sparsity.
_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H800 PCIe", 756e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
)


def peak_flops_for(device_name: str) -> Optional[float]:
    """The dense bf16 peak FLOP/s of a device named ``device_name``; None when it is not in the table (no MFU)."""
    return next((flops for part, flops in _PEAK_FLOPS if part in device_name), None)


def peak_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def model_flops_per_token(num_params: int, model_args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a Llama (``model_args``: its ModelArgs) with ``num_params`` parameters: 6 per
    parameter but the embedding's (a lookup, not a matmul) plus causal attention's score and value products. A tied
    embedding is counted once in ``num_params`` and is the output projection's matmul, so it stays."""
    embedding = 0 if model_args.enable_weight_tying else model_args.vocab_size * model_args.dim
    matmul_params = num_params - embedding
    return 6 * matmul_params + 12 * model_args.n_layers * model_args.n_heads * model_args.head_dim * seq_len


def rss_gib() -> float:
    """Resident set size of this process now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset: on CUDA what tensors held (allocated) and what the caching allocator
    held from the device (reserved: what runs out), in GiB and % of the device; on CPU the process RSS."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return cuda_memory_metrics(torch.cuda.memory_stats(device), total)
    return {"memory/rss(GiB)": rss_gib()}


def cuda_memory_metrics(stats: dict[str, int], device_bytes: int) -> dict[str, float]:
    """The peak allocated and reserved bytes of ``torch.cuda.memory_stats`` as GiB and % of ``device_bytes``."""
    metrics = {}
    for kind in ("allocated", "reserved"):
        peak = stats.get(f"{kind}_bytes.all.peak", 0)
        metrics[f"memory/max_{kind}(GiB)"] = peak / 2**30
        metrics[f"memory/max_{kind}(%)"] = 100 * peak / device_bytes
    return metrics


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def run_dir_name(optimizer_name: str, when: Optional[float] = None) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(when)) + f"_{optimizer_name}"


def run_header(world_size: int, device: torch.device) -> str:
    """The lines a run's ``job_config.toml`` starts with: how it was started, on what."""
    return (
        "The resolved config this run trained with; train.py --job.config_file reads it back to the same job.\n"
        f"command: {shlex.join(['train.py', *sys.argv[1:]])}\n"
        f"{world_size} process(es) on {device.type}, torch {torch.__version__}"
    )


def wandb_id_path(checkpoint_folder: str) -> str:
    """Where a run's W&B id is kept: beside its checkpoint folder (which holds checkpoints only)."""
    head, name = os.path.split(os.path.normpath(os.path.abspath(checkpoint_folder)))
    return os.path.join(head, f".{name}.wandb-run-id")


def read_wandb_record(id_path: Optional[str]) -> Optional[dict]:
    """The kept W&B run of a checkpoint folder: ``{"id", "step"}`` (the last step it logged; None when unknown, as
    in the plain id files of earlier versions); None when there is none."""
    if id_path is None or not os.path.isfile(id_path):
        return None
    with open(id_path) as f:
        text = f.read().strip()
    if not text:
        return None
    if text.startswith("{"):
        return json.loads(text)
    return {"id": text, "step": None}


def wandb_continuation(kept: Optional[dict], resumed_step: int, offline: bool) -> tuple[Optional[str], Optional[dict]]:
    """How a run resumed at ``resumed_step`` logs to W&B: (the id of the kept run it continues, or None) and (what
    a new run records it resumed from: the kept run's id and the step, or None).

    W&B keeps a run's history in increasing steps and drops any step logged again, so a run resumed from a
    checkpoint older than the kept run's last logged step would show the abandoned attempt's values: it starts a
    new run in the same group instead, linked to the old one. So does every resumed offline run (an offline run is
    never continued: each attempt is its own, uploaded by ``wandb sync``)."""
    if kept is None or resumed_step <= 0:
        return None, None
    last = kept.get("step")
    if not offline and (last is None or last <= resumed_step):
        return kept["id"], None
    return None, {"run_id": kept["id"], "step": resumed_step}


def start_wandb(job_config, run_dir: str, id_path: Optional[str], resumed_step: int):
    """A W&B run for this training run: the kept run it continues, or a new one (see :func:`wandb_continuation`)."""
    import wandb

    m = job_config.metrics
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
    run_id, resumed_from = wandb_continuation(read_wandb_record(id_path), resumed_step, offline)
    name = m.wandb_run_name or os.path.basename(os.path.normpath(run_dir))
    config = job_config.to_dict()
    if resumed_from is not None:
        name = f"{name}-from-step{resumed_step}"
        config["resumed_from"] = resumed_from
    run = wandb.init(
        project=m.wandb_project,
        entity=m.wandb_entity,
        name=name,
        group=m.wandb_group,
        config=config,
        dir=run_dir,
        id=run_id,
        resume="allow" if run_id is not None else None,
        notes=None if resumed_from is None else f"resumed at step {resumed_step} from W&B run {resumed_from['run_id']}",
    )
    if id_path is not None:
        write_text_atomically(id_path, json.dumps({"id": run.id, "step": resumed_step or None}))
    how = " (continued)" if run_id is not None else ""
    if resumed_from is not None:
        how = f" (a new run: resumed at step {resumed_step} from W&B run {resumed_from['run_id']})"
    logger.info(f"metrics: W&B run {run.id}{how}")
    return run


class MetricLogger:
    """Writes scalars to TensorBoard, metrics.jsonl and W&B; a no-op without a run folder (ranks other than 0,
    unless ``metrics.rank_0_only`` is off)."""

    def __init__(
        self,
        run_dir: Optional[str],
        enable_tensorboard: bool,
        wandb_run: Any = None,
        wandb_record: Optional[str] = None,
    ):
        self.run_dir = run_dir
        self.writer = None
        self.jsonl = None
        self.wandb_run = wandb_run
        self.wandb_record = wandb_record  # the kept run's id file: its last logged step follows each log
        if run_dir is None:
            return
        os.makedirs(run_dir, exist_ok=True)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(run_dir, max_queue=1000)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run_dir is None:
            return
        if self.writer is not None:
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
            if self.wandb_record is not None:
                write_text_atomically(self.wandb_record, json.dumps({"id": self.wandb_run.id, "step": step}))

    def write_record(self, name: str, text: str) -> None:
        """Write a file of facts about the run (``dataset.json``, ``job_config.toml``) into its folder, whole or not
        at all; nothing without a folder."""
        if self.run_dir is not None:
            write_text_atomically(os.path.join(self.run_dir, name), text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def build_metric_logger(
    job_config,
    optimizer_name: str,
    rank: int,
    group=None,
    checkpoint_folder: Optional[str] = None,
    resumed=False,
    resumed_step: Optional[int] = None,
) -> MetricLogger:
    """Rank 0's logger writes a new run folder; with ``metrics.rank_0_only`` off every other rank writes ``rank_N``
    inside the folder rank 0 chose (shared over ``group``, the world: ranks never guess the name on their own).

    With ``metrics.enable_wandb``, rank 0 (the global one) also logs to W&B; its run id is kept beside
    ``checkpoint_folder`` (None: checkpointing is off), and a run ``resumed`` at ``resumed_step`` continues the run
    kept there or starts one linked to it (:func:`wandb_continuation`)."""
    m = job_config.metrics
    chosen = _new_run_dir(job_config, optimizer_name) if rank == 0 else None
    if not m.rank_0_only:
        chosen = all_gather_objects(chosen, group)[0]  # every rank calls this: rank 0's choice, everywhere
    step = (resumed_step if resumed_step is not None else 1) if resumed else 0
    wandb_run = _start_wandb_on_rank_0(job_config, rank, group, chosen, checkpoint_folder, step)
    if rank != 0:
        return MetricLogger(None if m.rank_0_only else os.path.join(chosen, f"rank_{rank}"), m.enable_tensorboard)
    logger.info(f"metrics go to {chosen}")
    record = wandb_id_path(checkpoint_folder) if wandb_run is not None and checkpoint_folder is not None else None
    return MetricLogger(chosen, m.enable_tensorboard, wandb_run, record)


def _start_wandb_on_rank_0(job_config, rank: int, group, run_dir, checkpoint_folder, resumed_step: int):
    """Rank 0's W&B run (None elsewhere, or with W&B off). Every rank learns whether it started, so that a failure
    (not logged in, say) stops all of them with rank 0's one-line error instead of leaving the others waiting."""
    if not job_config.metrics.enable_wandb:
        return None
    run, problem = None, None
    if rank == 0:
        id_path = wandb_id_path(checkpoint_folder) if checkpoint_folder is not None else None
        try:
            run = start_wandb(job_config, run_dir, id_path, resumed_step)
        except Exception as e:  # noqa: BLE001 - wandb's own errors (login, network, permissions) end as one line
            problem = (
                f"metrics.enable_wandb: W&B could not start ({type(e).__name__}: {str(e).splitlines()[0]}); run "
                "`wandb login`, or set WANDB_MODE=offline to log without network and `wandb sync` later"
            )
    problem = all_gather_objects(problem, group)[0]
    if problem is not None:
        raise UserError(problem)
    return run


def _new_run_dir(job_config, optimizer_name: str) -> str:
    base = os.path.join(job_config.job.dump_folder, job_config.metrics.save_tb_folder)
    run_dir = os.path.join(base, run_dir_name(optimizer_name))
    suffix = 1
    while os.path.exists(run_dir):  # two runs started in the same second never share a folder
        suffix += 1
        run_dir = os.path.join(base, run_dir_name(optimizer_name) + f"-{suffix}")
    return run_dir


# ANSI colours of the log line's fields (metrics.enable_color_printing).
_COLORS = ("\033[31m", "\033[36m", "\033[33m", "\033[34m", "\033[32m", "\033[35m", "\033[37m")
_RESET = "\033[39m"


def format_log_line(step: int, m: dict[str, float], color: bool = False) -> str:
    parts = _log_fields(step, m)
    if color:
        parts = [f"{_COLORS[i % len(_COLORS)]}{part}{_RESET}" for i, part in enumerate(parts)]
    return "  ".join(parts)


def _log_fields(step: int, m: dict[str, float]) -> list[str]:
    parts = [
        f"step: {step:>5}",
        f"loss: {m['loss_metrics/global_avg_loss']:.8f}",
        f"grad_norm: {m['grad_norm']:.4f}",
        f"lr: {m['lr']:.4e}",
        f"tps: {m['throughput/tps']:,.0f}",
    ]
    if "memory/max_allocated(GiB)" in m:
        parts.append(
            f"memory: {m['memory/max_allocated(GiB)']:.2f}GiB({m['memory/max_allocated(%)']:.1f}%) allocated "
            f"{m['memory/max_reserved(GiB)']:.2f}GiB({m['memory/max_reserved(%)']:.1f}%) reserved"
        )
    else:
        parts.append(f"memory: {m['memory/rss(GiB)']:.2f}GiB rss")
    if "mfu(%)" in m:
        parts.append(f"mfu: {m['mfu(%)']:.2f}%")
    if "time/optimizer(s)" in m:
        parts.append(
            f"ms/step: data {m['time/data(s)'] * 1e3:.0f} fwd+bwd {m['time/forward_backward(s)'] * 1e3:.0f} "
            f"optimizer {m['time/optimizer(s)'] * 1e3:.0f} checkpoint {m['time/checkpoint(s)'] * 1e3:.0f}"
        )
    if m.get("health/loss_spikes"):
        parts.append(f"loss spikes: {m['health/loss_spikes']:.0f}")
    return parts


def format_validation_line(step: int, m: dict[str, float], tokens: int) -> str:
    # Worded unlike the training line, so that tools reading "step: N  loss: X" lines never mistake it for one.
    return (
        f"validation at step {step}: loss {m['validation/loss']:.8f}  "
        f"perplexity {m['validation/perplexity']:.4f}  ({tokens:,} tokens)"
    )
