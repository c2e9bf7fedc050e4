"""One rank of the 8B seed run, measured on one GPU: what PyTorch's CUDA caching allocator reserves for that step.

The seed run (``tests/estimation/llama3_8b_seed_run.toml``: Llama 3 8B, FSDP 8, batch 1 x 8192, no activation
checkpointing, compiled blocks, one loss chunk) measured 71.94 GiB peak reserved with AdamW and 65.75 GiB with
Adam-mini. Here one process is rank 0 of a fake process group of the job's 8 ranks (torch's ``fake`` backend):
collectives return at once and their values are garbage, but every tensor is a real CUDA tensor, so the allocator
sees the rank's own allocations and frees. The model, its parallelisation (compile, FSDP2), its initial weights, the
optimizer and its state are built by the trainer's own builders, and ``train_step`` runs the trainer's step (without
the divergence guard: garbage values may make the loss NaN, and a skipped update would leave the optimizer step
unmeasured).

``python -m torchtitan.gpu_check.seed_run --optimizer NAME --out FILE [--dry-run]`` measures one optimizer in a
process of its own (an empty allocator, the ``PYTORCH_CUDA_ALLOC_CONF`` of its environment) and writes to ``FILE``:
peaks of allocated and reserved memory and the phase of each, the allocator's retries, and a summary of
``torch.cuda.memory._snapshot()`` at the end of the phase that set the reserved peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

import torch

from torchtitan.distributed.cuda_allocator import ALLOC_CONF_VARIABLES, alloc_conf_in_effect
from torchtitan.gpu_check.context import GIB, REPO_ROOT, Context, StepResult, log_path, run_command, step_env

SEED_RUN_CONFIG = REPO_ROOT / "tests" / "estimation" / "llama3_8b_seed_run.toml"
# What the seed run measured per GPU (torch.cuda.max_memory_reserved), by optimizer.
SEED_RUN_RESERVED_GIB = {"AdamW": 71.94, "AdamMini": 65.75}
SEED_RUN_OPTIMIZERS = tuple(SEED_RUN_RESERVED_GIB)
SEED_RUN_STEPS = 3  # the state exists from the start (as train.py creates it); steps 2 and 3 show the steady state
MIB = 2**20


def seed_job(optimizer: str, overrides: tuple[str, ...] = ()):
    """The seed run's job with ``optimizer``; ``overrides`` shrink it for a dry run."""
    from torchtitan.config.job_config import JobConfig

    argv = ["--job.config_file", str(SEED_RUN_CONFIG), "--optimizer.name", optimizer, *overrides]
    return JobConfig.parse_args(argv, prog="gpu_check seed_run")


def summarize_snapshot(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stream, from ``torch.cuda.memory._snapshot()``: its segments, reserved, allocated and free bytes, and its
    largest free block (the largest request it could serve without reserving more). Streams in order of reserved
    bytes; the default stream is named ``default``."""
    streams: dict[int, dict[str, Any]] = {}
    for segment in snapshot.get("segments", []):
        row = streams.setdefault(
            segment["stream"], {"segments": 0, "reserved": 0, "allocated": 0, "largest free block": 0}
        )
        row["segments"] += 1
        row["reserved"] += segment["total_size"]
        row["allocated"] += segment["allocated_size"]
        free_blocks = [b["size"] for b in segment.get("blocks", []) if b["state"] == "inactive"]
        row["largest free block"] = max([row["largest free block"], *free_blocks])
    rows = []
    for stream, row in sorted(streams.items(), key=lambda item: -item[1]["reserved"]):
        rows.append(
            {
                "stream": "default" if stream == 0 else hex(stream),
                "segments": row["segments"],
                "reserved GiB": round(row["reserved"] / GIB, 2),
                "allocated GiB": round(row["allocated"] / GIB, 2),
                "free GiB": round((row["reserved"] - row["allocated"]) / GIB, 2),
                "largest free block MiB": round(row["largest free block"] / MIB, 1),
            }
        )
    return rows


class PhasePeaks:
    """Peak allocated and reserved bytes of each phase of the steps, and the allocator's snapshot at the end of the
    phase with the highest reserved peak. Reserved memory only grows unless the allocator frees cached segments to
    retry a request, so the snapshot shows the segments as that peak left them. Nothing is recorded on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.phase = ""
        self.peaks: dict[str, tuple[int, int]] = {}  # phase: (allocated, reserved)
        self.snapshot: Optional[dict[str, Any]] = None
        self.snapshot_phase = ""
        self.reserved_at_snapshot = 0

    def begin(self, phase: str) -> None:
        self.end()
        self.phase = phase

    def end(self) -> None:
        if not self.phase:
            return
        if self.cuda:
            allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            self.peaks[self.phase] = (allocated, reserved)
            if reserved > max((r for phase, (_, r) in self.peaks.items() if phase != self.phase), default=-1):
                self.snapshot, self.snapshot_phase = torch.cuda.memory._snapshot(), self.phase
                self.reserved_at_snapshot = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        self.phase = ""

    def summary(self) -> dict[str, Any]:
        if not self.peaks:
            return {"peak reserved GiB": None, "peak allocated GiB": None}
        reserved_phase = max(self.peaks, key=lambda p: self.peaks[p][1])
        allocated_phase = max(self.peaks, key=lambda p: self.peaks[p][0])
        return {
            "peak reserved GiB": round(self.peaks[reserved_phase][1] / GIB, 2),
            "reserved peak during": reserved_phase,
            "peak allocated GiB": round(self.peaks[allocated_phase][0] / GIB, 2),
            "allocated peak during": allocated_phase,
        }


def _random_batches(batch_size: int, seq_len: int, vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _capacity(job, device: torch.device, uncapped: bool) -> Optional[int]:
    """Cap this process at the seed run's GPU memory (``memory_estimation.device_memory_gib``) on a larger GPU, so
    that the allocator frees cached blocks and retries where the seed run's would; the bytes it may use (None on a
    CPU)."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    seed = int(job.memory_estimation.device_memory_gib * GIB)
    if uncapped or not seed or seed >= total:
        return total
    torch.cuda.set_per_process_memory_fraction(seed / total, device)
    return seed


@contextmanager
def _rank_zero_holds_the_first_rows() -> Iterator[None]:
    """Adam-mini learns which rows of a sharded weight its rank holds by gathering every rank's tags once; in a fake
    world the gather carries no values. Rank 0 of FSDP2's ``Shard(0)`` holds the first rows (as the estimate's fake
    tensors take them)."""
    from torchtitan.optim.adam_mini.layout import BlockLayout

    found = BlockLayout._find_local_rows
    BlockLayout._find_local_rows = lambda self, local: torch.arange(local.shape[0], device=local.device)
    try:
        yield
    finally:
        BlockLayout._find_local_rows = found


def measure(job, device: torch.device, steps: int = SEED_RUN_STEPS, uncapped: bool = False) -> dict[str, Any]:
    """Build rank 0 of ``job``'s world as the trainer does and run ``steps`` training steps; the row of what the
    allocator did (``fits`` says whether the steps ran out of memory) and the snapshot summary."""
    from torchtitan.config.preflight import model_args_for
    from torchtitan.distributed.utils import set_determinism, set_float32_matmul_precision
    from torchtitan.estimation.fake import fake_world
    from torchtitan.gpu_check.measure import is_oom
    from torchtitan.optim import build_optimizers
    from torchtitan.parallelisms import ParallelDims
    from torchtitan.training.step import build_model, init_model, train_step

    t = job.training
    world_size = job.memory_estimation.world_size
    parallel_dims = ParallelDims.from_job_config(job, world_size)
    if parallel_dims.dp_replicate > 1 or parallel_dims.tp > 1:
        raise ValueError(f"one rank of a fake world measures FSDP layouts only, not {parallel_dims.degrees}")
    model_args = model_args_for(job, job.memory_estimation.vocab_size)
    capacity = _capacity(job, device, uncapped)
    recorder = PhasePeaks(device)
    row: dict[str, Any] = {"capacity GiB": round(capacity / GIB, 1) if capacity else None, "steps": 0}
    if device.type == "cuda":
        row["GPU GiB"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 1)
    with fake_world(world_size) if world_size > 1 else nullcontext(), _rank_zero_holds_the_first_rows():
        set_determinism(t.seed, t.deterministic)
        if device.type == "cuda":
            set_float32_matmul_precision(t.tf32, device)
        mesh = parallel_dims.build_mesh(device.type) if world_size > 1 else None
        try:
            recorder.begin("building the model and optimizer state")
            model = build_model(job, model_args, parallel_dims, mesh, compute_device_type=device.type)
            init_model(model, device, t.seed)
            optimizers = build_optimizers([model], job)
            optimizers.initialise_state()  # as train.py does before its loop
            batches = _random_batches(t.batch_size, t.seq_len, model_args.vocab_size)
            hooks = [opt.register_step_pre_hook(lambda *_: _begin_step(recorder)) for opt in optimizers.optimizers]
            for step in range(1, steps + 1):
                recorder.begin(f"forward, backward, clipping (step {step})")
                loss, _, _ = train_step(model, optimizers, batches, parallel_dims, job, device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                row.update(steps=step, loss=str(round(float(loss), 4)))
            recorder.end()
            for hook in hooks:
                hook.remove()
            row["fits"] = "yes"
        except Exception as e:  # noqa: BLE001 - out of memory is this row's result
            if not is_oom(e):
                raise
            at = recorder.phase
            recorder.end()
            row["fits"] = f"no: out of memory during {at} within {row['capacity GiB']} GiB"
    row.update(recorder.summary())
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        row.update({"allocator retries": stats.get("num_alloc_retries", 0), "out of memory errors": stats["num_ooms"]})
    segments = summarize_snapshot(recorder.snapshot) if recorder.snapshot is not None else []
    snapshot = {"phase": recorder.snapshot_phase, "reserved GiB": round(recorder.reserved_at_snapshot / GIB, 2)}
    return {"row": row, "snapshot": {**snapshot, "streams": segments}}


def _begin_step(recorder: PhasePeaks) -> None:
    """The optimizer step begins (the first of the container's optimizers; the others continue its phase)."""
    if not recorder.phase.startswith("optimizer step"):
        step = recorder.phase.rsplit("(", 1)[-1]
        recorder.begin(f"optimizer step ({step}")


# ----------------------------------------------------------------------------------------------------------------
# The GPU check's step


TORCH_DEFAULTS = "torch's defaults"


def allocator_settings(env: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """(``PYTORCH_CUDA_ALLOC_CONF`` text, environment) to measure under: train.py's (the launcher's default, or the
    user's own), then torch's defaults (no setting)."""
    launcher, _ = alloc_conf_in_effect(env)
    bare = {k: v for k, v in env.items() if k not in ALLOC_CONF_VARIABLES}
    return [(launcher, env)] + ([("", bare)] if launcher else [])


def _measure_in_a_process(
    ctx: Context, name: str, conf: str, env: dict[str, str], uncapped: bool = False
) -> dict[str, Any]:
    """One optimizer's measurement in a fresh process under ``env``; its output is kept in the check's logs."""
    out = ctx.out / "seed_run" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torchtitan.gpu_check.seed_run", "--optimizer", name, "--out", str(out)]
    command += (["--dry-run"] if ctx.dry_run else []) + (["--uncapped"] if uncapped else [])
    if ctx.dry_run:  # on the CPU a process of its own proves nothing more than this one: the same code, sooner
        main(command[3:])
        return json.loads(out.read_text())
    done = run_command(command, ctx, env=env)
    label = "".join(c if c.isalnum() else "_" for c in conf) or "defaults"
    log = log_path(ctx.out, f"seed_run_8b/{name}-{label}{'-uncapped' if uncapped else ''}")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.output)
    if not done.ok or not out.is_file():
        tail = " / ".join(done.output.strip().splitlines()[-3:])[-600:]
        return {"row": {"fits": f"error: its process {done.how_it_ended()}: {tail}"}, "snapshot": None}
    return json.loads(out.read_text())


def _estimates(ctx: Context, names: list[str]) -> dict[str, Any]:
    """estimation.py's figures for the same job, by optimizer: its peaks and the reserved replay of each allocator
    setting."""
    from torchtitan.estimation import estimate_memory

    job = seed_job(names[0], ctx.sizes.seed_run_overrides)
    job.memory_estimation.optimizers = ",".join(names)
    return {name: o for name, o in zip(names, estimate_memory(job).optimizers)}


def _replay_of(estimate, conf: str):
    from dataclasses import replace

    from torchtitan.estimation.allocator import parse_alloc_conf

    wanted = replace(parse_alloc_conf(conf), text="")
    return next((r for r in estimate.reserved if replace(r.config, text="") == wanted), None)


def _compare(row: dict[str, Any], estimate, conf: str) -> None:
    """The estimate beside the measurement in ``row``, and the estimate's error against it."""
    replay = _replay_of(estimate, conf)
    row["estimated peak reserved GiB"] = round(replay.peak_reserved / GIB, 2) if replay else None
    row["estimated reserved peak during"] = replay.peak_reserved_phase if replay else None
    row["estimated peak allocated GiB"] = round(estimate.peak / GIB, 2)
    for kind in ("reserved", "allocated"):
        measured, estimated = row.get(f"peak {kind} GiB"), row[f"estimated peak {kind} GiB"]
        if measured and estimated is not None:
            row[f"{kind} estimate error %"] = round(100 * (estimated - measured) / measured, 1)


def snapshot_text(title: str, snapshot: dict[str, Any]) -> str:
    """A row's snapshot summary as an aligned table under ``title``."""
    lines = [f"{title}: at the end of {snapshot['phase']}, {snapshot['reserved GiB']} GiB reserved"]
    streams = snapshot["streams"]
    columns = list(streams[0]) if streams else []
    cells = [columns] + [[str(s[c]) for c in columns] for s in streams]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def step_seed_run_8b(ctx: Context) -> StepResult:
    """Rank 0 of the seed run on this GPU (a fake world of its 8 ranks): AdamW then AdamMini, each in a fresh
    process, under train.py's allocator setting then torch's defaults; beside each row, estimation.py's estimate
    of the same job and the seed run's measurement."""
    names = ctx.selected(SEED_RUN_OPTIMIZERS)
    result = StepResult()
    if not names:
        result.notes.append(f"none of {', '.join(SEED_RUN_OPTIMIZERS)} selected")
        return result
    result.notes.append(
        f"{SEED_RUN_CONFIG.relative_to(REPO_ROOT)} as rank 0 of a fake process group of its 8 ranks: real tensors "
        "and allocations, collectives without communication (their values, and so the loss, are garbage); "
        f"{SEED_RUN_STEPS} steps, the optimizer state created before the first as train.py does; on a GPU larger "
        "than the seed run's (memory_estimation.device_memory_gib) the process is capped at its memory, so that "
        "the allocator frees cached blocks and retries where the seed run's would"
    )
    texts = []
    for conf, env in allocator_settings(step_env(ctx)):
        for name in names:
            measured = _measure_in_a_process(ctx, name, conf, env)
            row = {"optimizer": name, "allocator": conf or TORCH_DEFAULTS, **measured["row"]}
            capped = row.get("capacity GiB") is not None and row["capacity GiB"] < row.get("GPU GiB", 0)
            if row.get("fits", "").startswith("no") and capped:  # measure what the whole GPU holds too
                result.rows.append(row)
                measured = _measure_in_a_process(ctx, name, conf, env, uncapped=True)
                row = {"optimizer": name, "allocator": conf or TORCH_DEFAULTS, **measured["row"]}
            elif row.get("fits", "").startswith("no"):
                result.notes.append(
                    f"{name} under {row['allocator']} does not fit this GPU: run `scripts/gpu_check.sh --only "
                    "seed_run` on a GPU with more memory (an H200, 141 GB)"
                )
            row["seed run reserved GiB"] = SEED_RUN_RESERVED_GIB[name]
            if row.get("peak reserved GiB"):
                row["vs seed run %"] = round(100 * (row["peak reserved GiB"] / SEED_RUN_RESERVED_GIB[name] - 1), 1)
            result.rows.append(row)
            if measured.get("snapshot") and measured["snapshot"]["streams"]:
                texts.append(snapshot_text(f"{name}, {row['allocator']}", measured["snapshot"]))
            result.text = "\n\n".join(texts)
            ctx.save(result)
    estimated = _estimates(ctx, names)
    for row in result.rows:
        conf = "" if row["allocator"] == TORCH_DEFAULTS else row["allocator"]
        _compare(row, estimated[row["optimizer"]], conf)
    result.notes += _savings(result.rows)
    return result


def _savings(rows: list[dict[str, Any]]) -> list[str]:
    """AdamW's reserved peak minus Adam-mini's, measured and estimated, per allocator setting, beside the seed
    run's."""
    seed = SEED_RUN_RESERVED_GIB["AdamW"] - SEED_RUN_RESERVED_GIB["AdamMini"]
    notes = []
    for conf in dict.fromkeys(row["allocator"] for row in rows):
        found = {r["optimizer"]: r for r in rows if r["allocator"] == conf and r.get("fits") == "yes"}
        if set(found) != set(SEED_RUN_OPTIMIZERS):
            continue

        measured, estimated = (_saving(found, key) for key in ("peak reserved GiB", "estimated peak reserved GiB"))
        notes.append(
            f"AdamW minus AdamMini, peak reserved, {conf}: measured {measured} GiB, estimated {estimated} GiB, "
            f"seed run {seed:.2f} GiB"
        )
    return notes


def _saving(rows: dict[str, dict[str, Any]], key: str) -> Optional[float]:
    values = [rows[name].get(key) for name in SEED_RUN_OPTIMIZERS]
    return None if None in values else round(values[0] - values[1], 2)


def main(argv: Optional[list[str]] = None) -> int:
    from torchtitan.gpu_check.context import Sizes, dry_run_settings

    parser = argparse.ArgumentParser(prog="python -m torchtitan.gpu_check.seed_run", description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", required=True)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="the dry run's tiny model on the CPU")
    parser.add_argument("--uncapped", action="store_true", help="use the whole GPU, not the seed run's memory")
    options = parser.parse_args(argv)
    sizes = Sizes.for_run(options.dry_run)
    with dry_run_settings() if options.dry_run else nullcontext():
        job = seed_job(options.optimizer, sizes.seed_run_overrides)
        result = measure(job, sizes.device, uncapped=options.uncapped)
    with open(options.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
