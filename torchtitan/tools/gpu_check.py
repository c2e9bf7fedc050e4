"""Every check that needs a GPU: ``scripts/gpu_check.sh --out DIR [--quick | --only STEPS_OR_GROUPS] [--dry-run]``.

Writes ``DIR/gpu_check.md`` (a table per step) and ``DIR/gpu_check.json``, both rewritten after every step, so a
check stopped at any point still reports what it measured. The plan is a list of named steps (:data:`STEPS`), each
with a time budget; each step runs in a process of its own (``python3 -m torchtitan.tools.gpu_check --child``),
started with the environment ``train.py`` trains in (its CUDA allocator setting, ``PYTHONPATH`` extended), and is
stopped at its budget: overrunning it, failing or lacking a package it needs (skipped, saying which) concerns that
step alone, and the rows it measured before stopping are kept. Running out of GPU memory is a result ("does not
fit"), not a failure. ``--dry-run`` runs the same plan on the CPU with tiny shapes and compilation off, so the test
suite keeps the check from rotting between GPU runs.

The plan is split into groups (:data:`GROUPS`) that each fit one device command of at most 9 minutes on one H200
by the per-step estimates of :data:`STEPS`; ``--quick`` is the group ``quick``. ``docs/gpu-check.md`` lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from torchtitan.config_manager import JobConfig
from torchtitan.cuda_allocator import allocator_environ, allocator_setting
from torchtitan.errors import UserError, exit_code
from torchtitan.garbage_collection import collecting_only_new_objects
from torchtitan.process_tree import kill_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
# Optimizers that also run with each implementation and with bf16 state; every registry name runs as it is.
VARIANT_KINDS = ("AdamW", "AdamMini")
VARIANT_OPTIONS = ("implementation=fused", "implementation=foreach", "state_dtype=bfloat16")
# The quick profile's optimizers at 1B (tokens/s, MFU, peaks beside the estimate) and at 8B (does it fit?).
QUICK_OPTIMIZERS = ("AdamW", "AdamMini", "AdamMini8bit", "Muon")
QUICK_8B = ("AdamW:implementation=fused", "AdamW:implementation=foreach", "AdamMini", "AdamMini8bit", "Muon")
# Seconds a command of a step may run before it is killed and counted as that step's (or check's) failure; never
# longer than what is left of the step's budget.
COMMAND_TIMEOUT_S = 300
PYTEST_TIMEOUT_S = 420
# A dry run's budget per step: the CPU of a loaded test machine, not an H200.
DRY_RUN_BUDGET_S = 420
FAILED = "FAILED"  # a component check's result when its command failed; fails the step
# Packages the check reports on its first line; a step or optimizer that needs a missing one is skipped.
PACKAGES = (
    "torch",
    "torchao",
    "torchdata",
    "datasets",
    "adam_mini",
    "pytest",
    "safetensors",
    "transformers",
    "tiktoken",
    "sentencepiece",
    "tensorboard",
    "matplotlib",
    "tomli_w",
)
TRAIN_PY_NEEDS = ("torchdata", "datasets", "tomli_w")  # train.py's data loader and its job_config.toml


# ----------------------------------------------------------------------------------------------------------------
# The plan's sizes


@dataclass
class Sizes:
    """What the steps train: a GPU's real sizes, or a dry run's tiny ones."""

    device: torch.device
    small_flavor: str  # the ~1B model
    large_flavor: str  # Llama 3 8B
    vocab_size: int
    batch_size: int
    seq_len: int
    warmup_steps: int
    timed_steps: int
    compile: bool  # for the steps that measure compiled training (estimates are of eager steps only)
    bench_runs: dict[str, tuple[tuple[str, str], ...]]  # per bench step: (shapes, dtype) of bench_optimizers.py
    bench_args: tuple[str, ...]
    train_overrides: tuple[str, ...]  # for train.py runs

    @classmethod
    def for_run(cls, dry_run: bool) -> Sizes:
        if dry_run:
            return cls(
                device=torch.device("cpu"),
                small_flavor="tiny",
                large_flavor="tiny",
                vocab_size=256,
                batch_size=1,
                seq_len=16,
                warmup_steps=1,
                timed_steps=1,
                compile=False,
                bench_runs={
                    "100m": (("tiny", "float32"),),
                    "1b": (("tiny", "float32"),),
                    "adam_mini": (("tiny", "float32"),),
                },
                bench_args=("--device", "cpu", "--steps", "1", "--warmup", "0"),
                train_overrides=("--training.seq_len", "32", "--training.batch_size", "1"),
            )
        return cls(
            device=torch.device("cuda"),
            small_flavor="1B",
            large_flavor="8B",
            vocab_size=128256,
            batch_size=2,
            seq_len=2048,
            warmup_steps=2,
            timed_steps=5,
            compile=True,
            bench_runs={
                "100m": (("bench", "float32"), ("bench", "bfloat16")),
                "1b": (("1b", "float32"), ("1b", "bfloat16")),
                "adam_mini": (("1b", "bfloat16"),),
            },
            bench_args=("--steps", "10", "--warmup", "2"),
            train_overrides=("--model.flavor", "debugmodel", "--training.compile", "true"),
        )


@contextlib.contextmanager
def _dry_run_settings() -> Iterator[None]:
    """The dry run's model (the debug model's structure at a few thousand parameters) and eager execution
    (torchao's per-step compile too: a dry run checks the wiring, not speed); both undone afterwards."""
    from torchtitan.models.llama import ModelArgs, llama3_configs

    llama3_configs["tiny"] = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16)
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        del llama3_configs["tiny"]


def optimizer_specs(kinds: Optional[list[str]] = None) -> list[str]:
    """Every registry optimizer, plus implementation and bf16-state variants of :data:`VARIANT_KINDS`, as
    ``NAME[:option=value]`` entries (estimation.py's ``memory_estimation.optimizers`` syntax)."""
    from torchtitan.optim.builder import OPTIMIZERS

    specs = []
    for name, kind in OPTIMIZERS.items():
        if kinds is not None and name not in kinds:
            continue
        specs.append(name)
        if name in VARIANT_KINDS:
            specs += [f"{name}:{o}" for o in VARIANT_OPTIONS if o.split("=")[0] in kind.options]
    return specs


def low_bit_names() -> list[str]:
    """The registry's optimizers with quantized state (those that take a quantization block size)."""
    from torchtitan.optim.builder import BLOCK_SIZE, OPTIMIZERS

    return [name for name, kind in OPTIMIZERS.items() if BLOCK_SIZE in kind.options]


# ----------------------------------------------------------------------------------------------------------------
# Training in this process (the trainer's own model building and step)


def _job(sizes: Sizes, flavor: str, *extra: str) -> JobConfig:
    argv = [
        "--model.flavor",
        flavor,
        "--training.batch_size",
        str(sizes.batch_size),
        "--training.seq_len",
        str(sizes.seq_len),
        "--training.compile",
        "false",  # eager unless the step asks for compile: estimation.py simulates eager steps
        "--training.max_norm",
        "1.0",
        "--memory_estimation.world_size",
        "1",
        "--memory_estimation.vocab_size",
        str(sizes.vocab_size),
        "--memory_estimation.device",
        sizes.device.type,
        *extra,
    ]
    return JobConfig.parse_args(argv, prog="gpu_check")


def _random_batches(sizes: Sizes, vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (sizes.batch_size, sizes.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peaks(device: torch.device) -> dict[str, Any]:
    """Peak allocated and reserved GiB since the last reset (None on CPU: the allocator keeps no peaks there)."""
    if device.type != "cuda":
        return {"peak allocated GiB": None, "peak reserved GiB": None}
    return {
        "peak allocated GiB": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
        "peak reserved GiB": round(torch.cuda.max_memory_reserved(device) / GIB, 2),
    }


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


@dataclass
class _Model:
    job: JobConfig
    model: torch.nn.Module
    args: Any
    parallel_dims: Any
    flops_per_token: float


def _build(sizes: Sizes, flavor: str, *extra: str) -> _Model:
    from torchtitan import training
    from torchtitan.metrics import model_flops_per_token
    from torchtitan.parallelisms import ParallelDims
    from torchtitan.preflight import model_args_for

    job = _job(sizes, flavor, *extra)
    args = model_args_for(job, sizes.vocab_size)
    dims = ParallelDims.from_job_config(job, 1)
    model = training.build_model(job, args, dims, None, compute_device_type=sizes.device.type)
    training.init_model(model, sizes.device, job.training.seed)
    params = sum(p.numel() for p in model.parameters())
    return _Model(job, model, args, dims, model_flops_per_token(params, args, job.training.seq_len))


def _error_text(e: BaseException) -> str:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def _train(built: _Model, spec: str, sizes: Sizes, steps: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """Warm-up then timed steps of ``spec``'s optimizer on ``built``; tokens/s, MFU and peaks of the timed steps,
    or ``fits: no`` when the GPU runs out of memory. The row names the optimizer step's implementation."""
    from torchtitan import training
    from torchtitan.estimation.simulate import job_for_optimizer, optimizer_choices, simulated_implementation
    from torchtitan.metrics import peak_flops
    from torchtitan.optim import build_optimizers

    warmup, timed = steps or (sizes.warmup_steps, sizes.timed_steps)
    device = sizes.device
    job = job_for_optimizer(built.job, optimizer_choices(spec)[0], [])
    batches = _random_batches(sizes, built.args.vocab_size)
    optimizers = None
    row: dict[str, Any] = {"optimizer": spec, "implementation": simulated_implementation(job, device.type)}
    try:
        built.model.init_weights(seed=job.training.seed)
        optimizers = build_optimizers([built.model], job)
        for _ in range(warmup):
            training.train_step(built.model, optimizers, batches, built.parallel_dims, job, device)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(timed):
            loss, _, _ = training.train_step(built.model, optimizers, batches, built.parallel_dims, job, device)
        _sync(device)
        seconds = time.perf_counter() - start
        tps = sizes.batch_size * sizes.seq_len * timed / seconds
        peak = peak_flops(device)
        row.update(
            {
                "fits": "yes",
                "loss": round(float(loss), 4),
                "tokens/s": round(tps),
                "MFU %": round(100 * tps * built.flops_per_token / peak, 1) if peak else None,
                **_peaks(device),
            }
        )
    except Exception as e:  # noqa: BLE001 - the row says what happened; the next optimizer still runs
        if _is_oom(e):
            row.update({"fits": "no (out of memory)", **_peaks(device)})
        else:
            row["fits"] = f"error: {_error_text(e)}"
    finally:
        del optimizers
        for p in built.model.parameters():
            p.grad = None
        _free(device)
    return row


def _estimates(job: JobConfig, specs: list[str]) -> dict[str, Any]:
    """estimation.py's peak (GiB) of each spec's step, the same job simulated on one rank, with the implementation
    it simulated; a spec whose estimate fails gets its error instead, and the others are still estimated."""
    from torchtitan.estimation import estimate_memory

    def run(chosen: list[str]) -> dict[str, Any]:
        simulated = copy.deepcopy(job)
        simulated.memory_estimation.optimizers = ",".join(chosen)
        estimate = estimate_memory(simulated)
        return {
            spec: {"GiB": round(o.peak / GIB, 2), "implementation": o.implementation}
            for spec, o in zip(chosen, estimate.optimizers)
        }

    try:
        return run(specs)
    except Exception:  # noqa: BLE001 - one optimizer's failure must not hide the others' estimates
        labels: dict[str, Any] = {}
        for spec in specs:
            try:
                labels.update(run([spec]))
            except Exception as e:  # noqa: BLE001
                labels[spec] = {"GiB": None, "error": _error_text(e)}
        return labels


# ----------------------------------------------------------------------------------------------------------------
# Packages


def importable(names: tuple[str, ...] = PACKAGES) -> dict[str, Optional[str]]:
    """Each package's version (``"?"`` if it has none), or None where importing it fails."""
    import importlib
    import importlib.metadata

    found: dict[str, Optional[str]] = {}
    for name in names:
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a package that fails to import is missing, whatever the reason
            found[name] = None
            continue
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
        found[name] = str(version)
    return found


def imports_line(found: dict[str, Optional[str]]) -> str:
    present = [f"{name} {version}" for name, version in found.items() if version is not None]
    missing = [name for name, version in found.items() if version is None]
    return f"gpu_check: imports present: {', '.join(present) or 'none'}; missing: {', '.join(missing) or 'none'}"


def optimizer_needs(spec: str) -> tuple[str, ...]:
    """Packages an optimizer entry cannot be built without (the low-bit ones store their state with torchao)."""
    return ("torchao",) if spec.split(":")[0] in low_bit_names() else ()


def _missing(needs: tuple[str, ...], found: dict[str, Optional[str]]) -> list[str]:
    return [name for name in needs if found.get(name) is None]


def _skipped(needs: list[str]) -> str:
    return f"skipped: needs {', '.join(needs)} (not importable)"


# ----------------------------------------------------------------------------------------------------------------
# The steps


@dataclass
class Context:
    sizes: Sizes
    out: Path
    dry_run: bool
    optimizers: Optional[list[str]] = None  # registry names to run (None: all)
    found: dict[str, Optional[str]] = field(default_factory=dict)  # importable(): what this process can import
    step: str = ""  # the step running in this process (a child), whose partial results :meth:`save` writes
    deadline: Optional[float] = None  # time.monotonic() at which the step's budget ends

    def selected(self, specs: list[str] | tuple[str, ...]) -> list[str]:
        return [s for s in specs if self.optimizers is None or s.split(":")[0] in self.optimizers]

    def seconds_left(self, cap: float) -> float:
        """``cap``, or what is left of the step's budget if that is less (at least 1 s)."""
        if self.deadline is None:
            return cap
        return max(1.0, min(cap, self.deadline - time.monotonic()))

    def save(self, result: StepResult) -> None:
        """Write the step's results so far, where the parent reads them even if the step is stopped later."""
        if self.step:
            _write_atomically(result_path(self.out, self.step), json.dumps(_result_json(result), default=str))


@dataclass
class StepResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text: str = ""  # preformatted output (a tool's own table)


def _result_json(result: StepResult) -> dict[str, Any]:
    return {"rows": result.rows, "notes": result.notes, "text": result.text}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def result_path(out: Path, step: str) -> Path:
    return out / "steps" / f"{step}.json"


def imports_path(out: Path) -> Path:
    return out / "steps" / "imports.json"


def log_path(out: Path, step: str) -> Path:
    return out / "logs" / f"{step}.log"


def _optimizer_rows(
    ctx: Context,
    specs: list[str],
    flavor: str,
    *extra: str,
    estimate: bool = True,
    steps: Optional[tuple[int, int]] = None,
    note: str = "",
) -> StepResult:
    """Train each spec on one model of ``flavor``, saving the rows after each; then, for eager runs, estimation.py's
    peak of the same job beside each row (measurements first: a step stopped at its budget keeps them)."""
    sizes = ctx.sizes
    result = StepResult()
    rows = result.rows
    runnable = []
    for spec in specs:
        missing = _missing(optimizer_needs(spec), ctx.found)
        if missing:
            rows.append({"optimizer": spec, "fits": _skipped(missing)})
        else:
            runnable.append(spec)
    try:
        built = _build(sizes, flavor, *extra)
    except Exception as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        rows += [{"optimizer": s, "fits": "no (weights alone)"} for s in runnable]
        return result
    params = sum(p.numel() for p in built.model.parameters())
    mode = "compiled" if built.job.training.compile else "eager"
    warmup, timed = steps or (sizes.warmup_steps, sizes.timed_steps)
    t = built.job.training
    # One GPU computes in mixed_precision_param (autocast); a CPU in the weights' dtype.
    compute = t.mixed_precision_param if sizes.device.type == "cuda" else t.param_dtype
    result.notes.append(
        f"{params / 1e9:.3f}B parameters, batch {sizes.batch_size} x {sizes.seq_len} tokens, {mode}, activation "
        f"checkpointing {built.job.activation_checkpoint.mode}, {t.param_dtype} weights, {compute} compute "
        f"on {sizes.device.type}; {timed} timed steps after {warmup} warm-up; allocator: "
        f"{allocator_setting(os.environ)}" + (f"; {note}" if note else "")
    )
    trained = {}
    for spec in runnable:
        trained[spec] = _train(built, spec, sizes, steps)
        rows.append(trained[spec])
        ctx.save(result)
    job = built.job
    del built
    _free(sizes.device)
    if not estimate or not trained:
        return result
    estimated = _estimates(job, list(trained))
    for spec, row in trained.items():
        found = estimated.get(spec, {})
        row["estimated peak allocated GiB"] = found.get("GiB")
        if "error" in found:
            row["estimate"] = f"error: {found['error']}"
        elif found.get("implementation") != row["implementation"]:  # the estimate must be of the same step
            row["estimate"] = f"error: simulated {found.get('implementation')}"
    result.notes.append(
        "estimated peak allocated: estimation.py's simulation of the same job (eager, one rank, the same "
        "optimizer step implementation)"
    )
    return result


def _compile_args(sizes: Sizes) -> tuple[str, ...]:
    return ("--training.compile", str(sizes.compile).lower())


def step_adam_mini_step_1b(ctx: Context) -> StepResult:
    """Adam-mini's fused step against fused AdamW's, bf16 weights at ~1B (``benchmarks/bench_optimizers.py``)."""
    return _bench(ctx, ctx.sizes.bench_runs["adam_mini"], ["--only", "AdamMini (fused)"])


def step_optimizers_1b(ctx: Context) -> StepResult:
    return _optimizer_rows(ctx, ctx.selected(QUICK_OPTIMIZERS), ctx.sizes.small_flavor)


def optimizers_1b_variant_specs() -> list[str]:
    """The implementation and state-dtype variants, and registry names with no variant nor a quantized state."""
    quick_or_low_bit = set(QUICK_OPTIMIZERS) | set(low_bit_names())
    return [s for s in optimizer_specs() if ":" in s or s not in quick_or_low_bit]


def optimizers_1b_more_specs() -> list[str]:
    """The registry's low-bit optimizers outside the quick profile."""
    done = set(QUICK_OPTIMIZERS) | set(optimizers_1b_variant_specs())
    return [s for s in optimizer_specs() if s not in done]


def step_optimizers_1b_variants(ctx: Context) -> StepResult:
    return _optimizer_rows(ctx, ctx.selected(optimizers_1b_variant_specs()), ctx.sizes.small_flavor)


def step_optimizers_1b_more(ctx: Context) -> StepResult:
    return _optimizer_rows(ctx, ctx.selected(optimizers_1b_more_specs()), ctx.sizes.small_flavor)


def step_compiled_1b(ctx: Context) -> StepResult:
    return _optimizer_rows(
        ctx,
        ctx.selected(("AdamW", "AdamMini")),
        ctx.sizes.small_flavor,
        *_compile_args(ctx.sizes),
        estimate=False,
        note="no estimate: estimation.py simulates eager steps only",
    )


_8B_EXTRA = ("--activation_checkpoint.mode", "full")


def step_llama3_8b(ctx: Context) -> StepResult:
    return _optimizer_rows(ctx, ctx.selected(QUICK_8B), ctx.sizes.large_flavor, *_8B_EXTRA, steps=(1, 2))


def llama3_8b_more_specs() -> list[str]:
    """The registry's optimizers that the quick profile does not run at 8B."""
    quick = {s.split(":")[0] for s in QUICK_8B}
    return [s for s in optimizer_specs() if ":" not in s and s not in quick]


def step_llama3_8b_more(ctx: Context) -> StepResult:
    return _optimizer_rows(ctx, ctx.selected(llama3_8b_more_specs()), ctx.sizes.large_flavor, *_8B_EXTRA, steps=(1, 2))


def _bench(ctx: Context, runs: tuple[tuple[str, str], ...], extra: list[str]) -> StepResult:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks import bench_optimizers

    text = []
    for shapes, dtype in runs:
        captured = io.StringIO()
        argv = ["--shapes", shapes, "--dtype", dtype, *ctx.sizes.bench_args, *extra]
        with contextlib.redirect_stdout(captured):
            bench_optimizers.main(argv)
        text.append(f"$ bench_optimizers.py {' '.join(argv)}\n{captured.getvalue()}")
        ctx.save(StepResult(text="\n".join(text)))
        _free(ctx.sizes.device)
    return StepResult(text="\n".join(text))


def bench_optimizer_names(ctx: Context) -> list[str]:
    """The registry names ``bench_optimizers.py --optimizers`` gets: those it times that are selected and can be
    built here."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.bench_optimizers import FAMILIES

    return [n for n in ctx.selected(FAMILIES) if not _missing(optimizer_needs(n), ctx.found)]


def _bench_selected(ctx: Context, runs: tuple[tuple[str, str], ...]) -> StepResult:
    names = bench_optimizer_names(ctx)
    if not names:
        return StepResult(notes=["none of the selected optimizers is timed by bench_optimizers.py"])
    return _bench(ctx, runs, ["--optimizers", ",".join(names)])


def step_bench_optimizers_100m(ctx: Context) -> StepResult:
    return _bench_selected(ctx, ctx.sizes.bench_runs["100m"])


def step_bench_optimizers_1b(ctx: Context) -> StepResult:
    return _bench_selected(ctx, ctx.sizes.bench_runs["1b"])


def step_float8(ctx: Context) -> StepResult:
    from torchtitan.parallelisms.parallelize_llama import check_float8_supported

    sizes = ctx.sizes
    result = StepResult(notes=["a ~1B Llama, compiled, AdamW; no estimate: estimation.py simulates eager steps"])
    for enabled in (False, True):
        row = {"float8": "on" if enabled else "off"}
        if enabled:
            try:
                check_float8_supported()
            except UserError as e:
                result.rows.append({**row, "fits": f"not run: {e}"})
                continue
        built = _build(
            sizes, sizes.small_flavor, "--float8.enable_float8_linear", str(enabled).lower(), *_compile_args(sizes)
        )
        result.rows.append({**row, **_train(built, "AdamW", sizes)})
        ctx.save(result)
        del built
        _free(sizes.device)
    return result


def step_async_checkpoint(ctx: Context) -> StepResult:
    """train.py saves asynchronously at steps 2 and 4; a second run resumes from step 4 and trains to 6."""
    dump = ctx.out / "async_checkpoint"
    shutil.rmtree(dump, ignore_errors=True)  # the first run must not resume from an earlier gpu_check's checkpoints
    common = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        *ctx.sizes.train_overrides,
        "--checkpoint.enable_checkpoint",
        "true",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.interval",
        "2",
        "--metrics.log_freq",
        "1",
        "--training.warmup_steps",
        "1",
    ]
    result = StepResult()
    rows = result.rows
    for steps in (4, 6):
        started = time.perf_counter()
        done = _run_command([*common, "--training.steps", str(steps)], ctx)
        log = done.output
        (dump / f"train_to_{steps}.log").parent.mkdir(parents=True, exist_ok=True)
        (dump / f"train_to_{steps}.log").write_text(log)
        resumed = "resumed from step 4" in log
        last_line = next((line for line in reversed(log.splitlines()) if "step:" in line), "")
        rows.append(
            {
                "run": f"train to step {steps}",
                "exit code": done.returncode,  # None: killed at the timeout
                "resumed from step 4": resumed,
                "seconds": round(time.perf_counter() - started, 1),
                "last log line": last_line.split(" - ")[-1].strip()[:160],
            }
        )
        ctx.save(result)
        if not done.ok:
            raise RuntimeError(f"train.py {done.how_it_ended()}:\n{log[-3000:]}")
    if not rows[1]["resumed from step 4"]:
        raise RuntimeError("the second run did not resume from the asynchronous checkpoint of step 4")
    return result


def step_checkpoint_memory(ctx: Context) -> StepResult:
    """Peak allocated memory above the state while CheckpointManager saves and loads, per low-bit optimizer (and
    AdamW as the float32 reference), synchronous and asynchronous: ``scripts/checkpoint_memory.py``, which fails
    when a rise exceeds its bound (derived from the optimizer's largest state tensor)."""
    names = ctx.selected(["AdamW", *low_bit_names()])
    notes = [
        f"{n}: {_skipped(_missing(optimizer_needs(n), ctx.found))}"
        for n in names
        if _missing(optimizer_needs(n), ctx.found)
    ]
    names = [n for n in names if not _missing(optimizer_needs(n), ctx.found)]
    if not names:
        return StepResult(notes=notes or ["no AdamW or low-bit optimizer selected"])
    text = []
    for extra in ([], ["--async-save"]):
        command = [sys.executable, str(REPO_ROOT / "scripts" / "checkpoint_memory.py"), "--optimizers", ",".join(names)]
        command += extra + (["--dry-run"] if ctx.dry_run else [])
        done = _run_command(command, ctx)
        text.append(f"$ checkpoint_memory.py {' '.join(command[2:])}\n{done.output}")
        ctx.save(StepResult(notes=notes, text="\n".join(text)))
        if not done.ok:
            raise RuntimeError("\n".join(text))
    return StepResult(notes=notes, text="\n".join(text))


def component_commands(out: Path) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """(what it checks, command, packages it needs) of the GPU checks that other parts of the project ship as their
    own scripts."""
    python = sys.executable
    hf_dump, hf_import_dump = (str(folder) for folder in _hf_folders(out))
    debug = ["train.py", "--job.config_file", "train_configs/debug_model.toml", "--training.steps", "4"]
    # The debug model tied and scaled as Llama 3.2 is: the Hugging Face round trip of both on the GPU.
    llama32 = ["--model.rope_scaling", "llama3", "--model.rope_scaling_factor", "32", "--model.enable_weight_tying"]
    return [
        (
            "chunked loss at 8B shapes (2 blocks): tokens/s and peak, 1 vs 8 chunks",
            [
                python,
                "benchmarks/bench_loss.py",
                "--device",
                "cuda",
                "--job.config_file",
                "train_configs/llama3_8b.toml",
            ]
            + ["--n_layers", "2", "--chunks", "1,8", "--rounds", "10"],
            (),
        ),
        (
            "bf16 stochastic rounding: compiled on CUDA equals eager on CPU",
            [
                python,
                "-c",
                "import torch; from torchtitan.optim.state.storage import round_to_bfloat16_stochastically as r; "
                "x = torch.randn(1 << 20, device='cuda'); s = torch.tensor(7, device='cuda'); "
                "c = torch.compile(r, fullgraph=True, dynamic=False); "
                "assert torch.equal(c(x, s).cpu(), r(x.cpu(), s.cpu())); print('equal')",
            ],
            (),
        ),
        (
            "bf16 state rounding: speed on the GPU",
            [python, "benchmarks/bf16_momentum_rounding.py", "--speed-only", "cuda"],
            (),
        ),
        (
            "data loader: tokens/s per rank at 1 and 4 simulated ranks",
            [python, "benchmarks/bench_data_loader.py"],
            TRAIN_PY_NEEDS,
        ),
        (
            "Hugging Face export of a bf16 run, tied and scaled as Llama 3.2 is, with a fused RMSNorm and time-based "
            "pinned async saves",
            [python, *debug, "--job.dump_folder", hf_dump, "--model.norm_type", "fused_rmsnorm", *llama32]
            + ["--checkpoint.enable_checkpoint", "--checkpoint.interval_type", "seconds", "--checkpoint.interval", "1"]
            + ["--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.last_save_in_hf"]
            + ["--checkpoint.export_dtype", "bfloat16", "--training.gc_freq", "2"],
            (*TRAIN_PY_NEEDS, "safetensors"),
        ),
        (
            "Hugging Face import of that export, with a compiled RMSNorm",
            [python, *debug, "--job.dump_folder", hf_import_dump, "--model.norm_type", "compiled_rmsnorm", *llama32]
            + ["--checkpoint.initial_load_path", f"{hf_dump}/checkpoint/AdamW/step-4-hf"]
            + ["--checkpoint.initial_load_in_hf"],
            (*TRAIN_PY_NEEDS, "safetensors"),
        ),
    ]


def _hf_folders(out: Path) -> tuple[Path, Path]:
    """The dump folders of the component checks' Hugging Face export and import runs."""
    return out / "hf-roundtrip", out / "hf-roundtrip-import"


def step_component_checks(ctx: Context) -> StepResult:
    """The GPU checks of the chunked loss, bf16 state rounding, the data loader and Hugging Face weights, each its
    own command (listed, not run, in a dry run: they need CUDA); a command that fails or times out fails the step,
    one whose packages are missing is skipped."""
    if not ctx.dry_run:
        for folder in _hf_folders(ctx.out):  # the export must not resume from an earlier gpu_check's checkpoints
            shutil.rmtree(folder, ignore_errors=True)
    result = StepResult()
    for what, command, needs in component_commands(ctx.out):
        shown = " ".join(command[1:])
        missing = _missing(needs, ctx.found)
        if ctx.dry_run:
            result.rows.append({"check": what, "command": shown, "result": "listed (dry run)"})
            continue
        if missing:
            result.rows.append({"check": what, "command": shown, "result": _skipped(missing)})
            continue
        done = _run_command(command, ctx)
        tail = " / ".join(done.output.strip().splitlines()[-6:])
        result.rows.append({"check": what, "command": shown, "result": "ok" if done.ok else FAILED, "output": tail})
        ctx.save(result)
    return result


def step_gpu_tests(ctx: Context) -> StepResult:
    files = gpu_test_files()
    if ctx.dry_run:
        return StepResult(rows=[{"test file": f, "result": "listed (dry run)"} for f in files])
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    done = _run_command(command, ctx, timeout=PYTEST_TIMEOUT_S)
    tail = "\n".join(done.output.splitlines()[-30:])
    if not done.ok:
        raise RuntimeError(f"pytest {done.how_it_ended()}:\n{tail}")
    return StepResult(text=tail)


def gpu_test_files() -> list[str]:
    """Test files that skip themselves without CUDA."""
    found = []
    for path in sorted((REPO_ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        if "skipif" in text and "cuda.is_available()" in text:
            found.append(str(path.relative_to(REPO_ROOT)))
    return found


@dataclass
class _Done:
    """How a step's command ended: its exit code (None: killed at the timeout) and its output."""

    returncode: Optional[int]
    output: str
    timeout: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def how_it_ended(self) -> str:
        if self.returncode is None:
            return f"timed out after {self.timeout} s"
        return f"exited with {self.returncode}"


def _run_command(command: list[str], ctx: Context, timeout: Optional[float] = None) -> _Done:
    """Run ``command`` in the repository root; past ``timeout`` seconds (default :data:`COMMAND_TIMEOUT_S`, and
    never past the step's budget) it is killed with its children, and the result says so."""
    timeout = round(ctx.seconds_left(COMMAND_TIMEOUT_S if timeout is None else timeout), 1)
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_env(ctx), start_new_session=True
        )
        returncode = _wait_or_kill(process, timeout)
        output.seek(0)
        text = output.read()
    if returncode is None:
        return _Done(None, f"{text}\n(timed out after {timeout} s)", timeout)
    return _Done(returncode, text, timeout)


def _wait_or_kill(process: subprocess.Popen, timeout: float) -> Optional[int]:
    """The exit code of ``process`` (started in a session of its own), or None if it ran past ``timeout`` seconds:
    then it and every process it started are killed, as they are if this process is stopped while it waits."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.wait()
        return None
    except BaseException:
        kill_tree(process.pid)
        process.wait()
        raise


def step_environment(dry_run: bool, environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of every step and command: the caller's, with ``train.py``'s CUDA allocator setting (kept
    as given if set), the repository first on ``PYTHONPATH`` (what was there kept after it: wheels installed beside
    the project stay importable), and in a dry run no GPU and no compile."""
    environ = dict(os.environ if environ is None else environ)
    env = {**environ, **allocator_environ(environ), "PYTHONUNBUFFERED": "1"}
    paths = [str(REPO_ROOT), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    return env


def _env(ctx: Context) -> dict[str, str]:
    return step_environment(ctx.dry_run)


@dataclass(frozen=True)
class Step:
    """A step of the plan: what it runs, what it should take on one H200 from a cold start (compiles included; the
    figure docs/gpu-check.md gives), the most it may take before it is stopped, and the packages it needs."""

    run: Callable[[Context], StepResult]
    estimate_s: int
    budget_s: int
    needs: tuple[str, ...] = ()


# The plan, in order; add a step by writing a function of a Context returning a StepResult, naming it here with its
# estimate and budget, and putting it in a group of GROUPS.
STEPS: dict[str, Step] = {
    "adam_mini_step_1b": Step(step_adam_mini_step_1b, estimate_s=70, budget_s=110),
    "optimizers_1b": Step(step_optimizers_1b, estimate_s=200, budget_s=250),
    "llama3_8b": Step(step_llama3_8b, estimate_s=170, budget_s=190),
    "optimizers_1b_variants": Step(step_optimizers_1b_variants, estimate_s=180, budget_s=250),
    "optimizers_1b_more": Step(step_optimizers_1b_more, estimate_s=240, budget_s=290, needs=("torchao",)),
    "llama3_8b_more": Step(step_llama3_8b_more, estimate_s=240, budget_s=290),
    "compiled_1b": Step(step_compiled_1b, estimate_s=180, budget_s=250),
    "bench_optimizers_100m": Step(step_bench_optimizers_100m, estimate_s=200, budget_s=260),
    "bench_optimizers_1b": Step(step_bench_optimizers_1b, estimate_s=240, budget_s=290),
    "float8": Step(step_float8, estimate_s=200, budget_s=250),
    "async_checkpoint": Step(step_async_checkpoint, estimate_s=70, budget_s=120, needs=TRAIN_PY_NEEDS),
    "checkpoint_memory": Step(step_checkpoint_memory, estimate_s=120, budget_s=180),
    "component_checks": Step(step_component_checks, estimate_s=300, budget_s=500),
    "gpu_tests": Step(step_gpu_tests, estimate_s=360, budget_s=480, needs=("pytest", "torchdata")),
}
# Groups of steps, each one device command of at most 9 minutes by the estimates (10 by the budgets, a command's
# limit); together every step once. ``--quick`` is "quick".
GROUPS: dict[str, tuple[str, ...]] = {
    "quick": ("adam_mini_step_1b", "optimizers_1b", "llama3_8b"),
    "optimizers": ("optimizers_1b_variants", "optimizers_1b_more"),
    "large": ("llama3_8b_more", "compiled_1b"),
    "bench": ("bench_optimizers_100m", "bench_optimizers_1b"),
    "training": ("float8", "async_checkpoint", "checkpoint_memory"),
    "components": ("component_checks",),
    "tests": ("gpu_tests",),
}
STARTUP_S = 15  # the check's own start and the import probe, before the first step


def group_seconds(steps: tuple[str, ...] | list[str], budget: bool = False) -> int:
    return STARTUP_S + sum(STEPS[s].budget_s if budget else STEPS[s].estimate_s for s in steps)


# ----------------------------------------------------------------------------------------------------------------
# Running the plan and the report


def _child_command(name: str, ctx: Context) -> list[str]:
    function = STEPS[name].run
    command = [sys.executable, "-m", "torchtitan.tools.gpu_check", "--out", str(ctx.out), "--child", name]
    command += ["--step-function", f"{function.__module__}:{function.__qualname__}"]
    command += ["--dry-run"] if ctx.dry_run else []
    command += ["--optimizers", ",".join(ctx.optimizers)] if ctx.optimizers else []
    return command


def step_budget(name: str, dry_run: bool) -> int:
    return DRY_RUN_BUDGET_S if dry_run else STEPS[name].budget_s


def run_step(name: str, ctx: Context) -> dict[str, Any]:
    """Run step ``name`` in a process of its own, stopped at its budget; what it measured, how it ended."""
    started = time.perf_counter()
    missing = _missing(STEPS[name].needs, ctx.found)
    if missing:
        outcome: dict[str, Any] = {"status": "skipped", "error": _skipped(missing), "seconds": 0.0}
        print(f"gpu_check: {name}: {outcome['error']}", flush=True)
        return outcome
    budget = step_budget(name, ctx.dry_run)
    saved = result_path(ctx.out, name)
    saved.unlink(missing_ok=True)
    log = log_path(ctx.out, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.Popen(
            _child_command(name, ctx),
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=_env(ctx),
            start_new_session=True,
        )
        returncode = _wait_or_kill(process, budget)
    result = json.loads(saved.read_text()) if saved.is_file() else {}
    saved.unlink(missing_ok=True)
    outcome = {"status": "ok", "rows": result.get("rows", []), "notes": result.get("notes", [])}
    outcome["text"] = result.get("text", "")
    if returncode is None:
        outcome.update(status="failed", error=f"stopped at its budget of {budget} s (what it measured is kept)")
    elif "error" in result:
        outcome.update(status="failed", error=result["error"], traceback=result.get("traceback", ""))
    elif returncode != 0 or not result.get("done"):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        outcome.update(status="failed", error=f"its process exited with {returncode} before finishing:\n{tail}")
    else:
        broken = broken_rows(outcome["rows"])
        if broken:  # the other rows were still measured
            outcome.update(
                status="failed", error=f"{len(broken)} of {len(outcome['rows'])} runs failed (see the table)"
            )
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    outcome["budget s"] = budget
    print(f"gpu_check: {name}: {outcome['status']} in {outcome['seconds']} s (budget {budget} s)", flush=True)
    return outcome


def broken_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of runs that failed: an error instead of a measurement or an estimate, a failed command."""
    return [
        row
        for row in rows
        if str(row.get("fits", "")).startswith("error")
        or str(row.get("estimate", "")).startswith("error")
        or row.get("result") == FAILED
    ]


def run_child(name: str, function: str, ctx: Context) -> int:
    """The body of a step's own process: run the step, saving its result where :func:`run_step` reads it."""
    import importlib

    module, _, qualname = function.partition(":")
    step = importlib.import_module(module)
    for part in qualname.split("."):
        step = getattr(step, part)
    ctx.step = name
    ctx.deadline = time.monotonic() + step_budget(name, ctx.dry_run) if name in STEPS else None
    ctx.found = json.loads(imports_path(ctx.out).read_text())  # the parent's probe
    try:
        with _dry_run_settings() if ctx.dry_run else contextlib.nullcontext(), collecting_only_new_objects():
            result = step(ctx)
    except Exception as e:  # noqa: BLE001 - the parent reports it as this step's failure
        partial = json.loads(result_path(ctx.out, name).read_text()) if result_path(ctx.out, name).is_file() else {}
        partial.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        _write_atomically(result_path(ctx.out, name), json.dumps(partial, default=str))
        traceback.print_exc()
        return 1
    _write_atomically(result_path(ctx.out, name), json.dumps({**_result_json(result), "done": True}, default=str))
    return 0


def probe_imports(ctx: Context) -> dict[str, Optional[str]]:
    """:func:`importable` in a process started as the steps are (the parent keeps CUDA untouched)."""
    code = "import json; from torchtitan.tools.gpu_check import importable; print(json.dumps(importable()))"
    done = _run_command([sys.executable, "-c", code], ctx, timeout=120)
    if not done.ok:
        raise RuntimeError(f"the import probe {done.how_it_ended()}:\n{done.output[-2000:]}")
    return json.loads(done.output.strip().splitlines()[-1])


def device_description(dry_run: bool) -> str:
    if dry_run:
        return "CPU (dry run)"
    # Without creating a CUDA context in this process (it would hold GPU memory the steps then lack).
    done = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True, text=True
        )
        if shutil.which("nvidia-smi")
        else None
    )
    return (
        done.stdout.strip().splitlines()[0] if done is not None and done.returncode == 0 and done.stdout else "CUDA GPU"
    )


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check ({'dry run' if report['dry_run'] else 'GPU'})", ""]
    lines += [f"{report['device']}, torch {report['torch']}, {report['seconds']} s so far", ""]
    lines += [f"- {report['imports']}", f"- allocator: {report['allocator']}", ""]
    for name, step in report["steps"].items():
        budget = f", budget {step['budget s']} s" if "budget s" in step else ""
        lines += [f"## {name}: {step['status']} ({step.get('seconds', 0)} s{budget})", ""]
        if step.get("error"):
            lines += ["```", step["error"], "```", ""]
        lines += [f"- {note}" for note in step.get("notes", [])] + ([""] if step.get("notes") else [])
        rows = step.get("rows", [])
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for row in rows:
                lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in columns) + " |")
            lines.append("")
        if step.get("text"):
            lines += ["```", step["text"].rstrip(), "```", ""]
    return "\n".join(lines)


def write_report(out: Path, report: dict[str, Any]) -> None:
    _write_atomically(out / "gpu_check.json", json.dumps(report, indent=1, default=str))
    _write_atomically(out / "gpu_check.md", markdown(report))


def run(out: Path, dry_run: bool, only: Optional[list[str]] = None, optimizers: Optional[list[str]] = None) -> dict:
    if not dry_run and not torch.cuda.is_available():
        raise UserError("no CUDA GPU found; run with --dry-run to check the plan on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(sizes=Sizes.for_run(dry_run), out=out, dry_run=dry_run, optimizers=optimizers)
    started = time.perf_counter()
    ctx.found = probe_imports(ctx)
    _write_atomically(imports_path(out), json.dumps(ctx.found))
    line = imports_line(ctx.found)
    print(line, flush=True)
    names = only or list(STEPS)
    report = {
        "dry_run": dry_run,
        "device": device_description(dry_run),
        "torch": torch.__version__,
        "imports": line,
        "allocator": allocator_setting(_env(ctx)),
        "seconds": 0.0,
        "steps": {name: {"status": "not run yet"} for name in names},
    }
    write_report(out, report)
    with _ended_by_sigterm():
        for name in names:
            try:
                report["steps"][name] = run_step(name, ctx)
            except _Ended as e:  # the step's processes are gone; what it saved is kept
                saved = result_path(out, name)
                partial = json.loads(saved.read_text()) if saved.is_file() else {}
                error = f"the check was ended ({e}) during this step"
                report["steps"][name] = {**partial, "status": "failed", "error": error}
                report["ended"] = str(e)
                break
            finally:
                report["seconds"] = round(time.perf_counter() - started, 1)
                write_report(out, report)
    if "ended" in report:
        print(f"gpu_check: ended by {report['ended']}; report in {out / 'gpu_check.md'}", flush=True)
    return report


class _Ended(Exception):
    """The check was asked to end (SIGTERM, as ``timeout`` sends)."""


@contextlib.contextmanager
def _ended_by_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`_Ended` where the check waits, so that the running step's processes (each in a session
    of its own, which the signal does not reach) are killed and the report says where it stopped."""

    def end(signum: int, frame: Any) -> None:
        raise _Ended(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def steps_of(value: Optional[str]) -> Optional[list[str]]:
    """``--only``'s steps: step and group names, comma-separated, in the plan's order."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS and n not in GROUPS]
    if unknown or not names:
        raise UserError(
            f"--only: unknown {', '.join(unknown) or 'empty list'}; choose from the steps {', '.join(STEPS)} or the "
            f"groups {', '.join(GROUPS)}"
        )
    chosen = {s for n in names for s in GROUPS.get(n, (n,))}
    return [s for s in STEPS if s in chosen]


def _names(value: Optional[str], valid: list[str], what: str) -> Optional[list[str]]:
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise UserError(f"--{what}: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(valid)}")
    return names


def main(argv: Optional[list[str]] = None) -> int:
    return exit_code(lambda: _main(argv))


def _main(argv: Optional[list[str]]) -> int:
    from torchtitan.optim.builder import OPTIMIZERS

    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.md, gpu_check.json and logs")
    parser.add_argument("--dry-run", action="store_true", help="the same plan on the CPU with tiny shapes")
    parser.add_argument("--quick", action="store_true", help=f"the quick profile: {', '.join(GROUPS['quick'])}")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated steps ({', '.join(STEPS)}) or groups ({', '.join(GROUPS)})"
    )
    parser.add_argument("--optimizers", default=None, help="comma-separated registry names (default: all)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a step's own process
    parser.add_argument("--step-function", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.quick and options.only:
        raise UserError("--quick is the group 'quick' of --only; give one of them")
    only = steps_of("quick" if options.quick else options.only)
    optimizers = _names(options.optimizers, list(OPTIMIZERS), "optimizers")
    out = Path(options.out)
    if options.child:
        ctx = Context(sizes=Sizes.for_run(options.dry_run), out=out, dry_run=options.dry_run, optimizers=optimizers)
        return run_child(options.child, options.step_function, ctx)
    report = run(out, options.dry_run, only, optimizers)
    failed = [name for name, step in report["steps"].items() if step["status"] == "failed"]
    print(f"gpu_check: report in {out / 'gpu_check.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
