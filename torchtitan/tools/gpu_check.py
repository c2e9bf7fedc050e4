"""Every check that needs a GPU, in one call: ``scripts/gpu_check.sh --out DIR [--dry-run] [--only a,b]``.

Writes ``DIR/gpu_check.md`` (a table per step) and ``DIR/gpu_check.json``. The plan is a list of named steps
(:data:`STEPS`); each runs on its own, so one that fails leaves the others' results, and running out of GPU memory
is a result ("does not fit"), not a failure. ``--dry-run`` runs the same plan on the CPU with tiny shapes and
compilation off, so the test suite keeps the script from rotting between GPU runs.

Steps (sizes on a GPU; the dry run shrinks every model to a few thousand parameters):

* ``optimizers_1b``: every optimizer of the registry (AdamW and AdamMini also with their implementations and bf16
  state) trains a ~1B Llama with compile on: tokens/s, MFU, peak allocated and reserved, and estimation.py's
  prediction of the peak allocated memory of the same step;
* ``bench_optimizers``: ``benchmarks/bench_optimizers.py`` ratios at ~100M and ~1B parameters, float32 and bf16;
* ``llama3_8b``: Llama 3 8B on the one GPU, full activation checkpointing, each registry optimizer: fits or not,
  peak, tokens/s;
* ``float8``: float8 linears on and off (a ~1B Llama, compiled);
* ``async_checkpoint``: ``train.py`` saves asynchronously, a second run resumes from it;
* ``checkpoint_memory``: peak memory of a checkpoint save and load for each low-bit optimizer;
* ``gpu_tests``: the test-suite files that need CUDA (skipped without one).
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
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from torchtitan.config_manager import JobConfig
from torchtitan.errors import UserError, exit_code

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
# Optimizers that also run with each implementation and with bf16 state; every registry name runs as it is.
VARIANT_KINDS = ("AdamW", "AdamMini")
VARIANT_OPTIONS = ("implementation=fused", "implementation=foreach", "state_dtype=bfloat16")
# Seconds a command of a step may run before it is killed and counted as that step's (or check's) failure.
COMMAND_TIMEOUT_S = 300
PYTEST_TIMEOUT_S = 420
FAILED = "FAILED"  # a component check's result when its command failed; fails the step


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
    compile: bool
    bench_runs: tuple[tuple[str, str], ...]  # (shapes, dtype) of bench_optimizers.py
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
                bench_runs=(("tiny", "float32"),),
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
            bench_runs=(("bench", "float32"), ("bench", "bfloat16"), ("1b", "float32"), ("1b", "bfloat16")),
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
        str(sizes.compile).lower(),
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


def _train(built: _Model, spec: str, sizes: Sizes, steps: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """Warm-up then timed steps of ``spec``'s optimizer on ``built``; tokens/s, MFU and peaks of the timed steps,
    or ``fits: no`` when the GPU runs out of memory."""
    from torchtitan import training
    from torchtitan.estimation.simulate import job_for_optimizer, optimizer_choices
    from torchtitan.metrics import peak_flops
    from torchtitan.optim import build_optimizers

    warmup, timed = steps or (sizes.warmup_steps, sizes.timed_steps)
    device = sizes.device
    job = job_for_optimizer(built.job, optimizer_choices(spec)[0], [])
    batches = _random_batches(sizes, built.args.vocab_size)
    optimizers = None
    row: dict[str, Any] = {"optimizer": spec}
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
            row["fits"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        del optimizers
        for p in built.model.parameters():
            p.grad = None
        _free(device)
    return row


def _estimates(job: JobConfig, specs: list[str]) -> dict[str, float]:
    """estimation.py's peak (GiB) of each spec's step: the same job, simulated on one rank."""
    from torchtitan.estimation import estimate_memory

    job = copy.deepcopy(job)
    job.memory_estimation.optimizers = ",".join(specs)
    estimate = estimate_memory(job)
    labels = {}
    for spec, o in zip(specs, estimate.optimizers):
        labels[spec] = round(o.peak / GIB, 2)
    return labels


# ----------------------------------------------------------------------------------------------------------------
# The steps


@dataclass
class Context:
    sizes: Sizes
    out: Path
    dry_run: bool
    optimizers: Optional[list[str]] = None  # registry names to run (None: all)


@dataclass
class StepResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text: str = ""  # preformatted output (a tool's own table)


def step_optimizers_1b(ctx: Context) -> StepResult:
    sizes = ctx.sizes
    specs = optimizer_specs(ctx.optimizers)
    built = _build(sizes, sizes.small_flavor)
    params = sum(p.numel() for p in built.model.parameters())
    estimated = _estimates(built.job, specs)
    rows = []
    for spec in specs:
        row = _train(built, spec, sizes)
        row["estimated peak allocated GiB"] = estimated.get(spec)
        rows.append(row)
    note = (
        f"{params / 1e9:.3f}B parameters, batch {sizes.batch_size} x {sizes.seq_len} tokens, compile "
        f"{'on' if sizes.compile else 'off'}, {built.job.training.mixed_precision_param} compute on "
        f"{sizes.device.type}; {sizes.timed_steps} timed steps after {sizes.warmup_steps} warm-up"
    )
    return StepResult(rows=rows, notes=[note])


def step_bench_optimizers(ctx: Context) -> StepResult:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks import bench_optimizers

    text = []
    for shapes, dtype in ctx.sizes.bench_runs:
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            bench_optimizers.main(["--shapes", shapes, "--dtype", dtype, *ctx.sizes.bench_args])
        text.append(f"$ bench_optimizers.py --shapes {shapes} --dtype {dtype}\n{captured.getvalue()}")
        _free(ctx.sizes.device)
    return StepResult(text="\n".join(text))


def step_llama3_8b(ctx: Context) -> StepResult:
    sizes = ctx.sizes
    specs = optimizer_specs(ctx.optimizers)
    specs = [s for s in specs if ":" not in s]  # one run per optimizer: the registry names
    try:
        built = _build(sizes, sizes.large_flavor, "--activation_checkpoint.mode", "full", "--training.compile", "false")
    except Exception as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        return StepResult(rows=[{"optimizer": s, "fits": "no (weights alone)"} for s in specs])
    rows = [_train(built, spec, sizes, steps=(1, 2)) for spec in specs]
    del built
    _free(sizes.device)
    return StepResult(rows=rows, notes=["full activation checkpointing, eager (no compile), 2 timed steps"])


def step_float8(ctx: Context) -> StepResult:
    from torchtitan.parallelisms.parallelize_llama import check_float8_supported

    sizes = ctx.sizes
    rows = []
    for enabled in (False, True):
        row = {"float8": "on" if enabled else "off"}
        if enabled:
            try:
                check_float8_supported()
            except UserError as e:
                rows.append({**row, "fits": f"not run: {e}"})
                continue
        built = _build(sizes, sizes.small_flavor, "--float8.enable_float8_linear", str(enabled).lower())
        rows.append({**row, **_train(built, "AdamW", sizes)})
        del built
        _free(sizes.device)
    return StepResult(rows=rows)


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
    rows = []
    for steps in (4, 6):
        started = time.perf_counter()
        done = _run_command([*common, "--training.steps", str(steps)], ctx)
        log = done.output
        (ctx.out / f"async_checkpoint_{steps}.log").write_text(log)
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
        if not done.ok:
            raise RuntimeError(f"train.py {done.how_it_ended()}:\n{log[-3000:]}")
    if not rows[1]["resumed from step 4"]:
        raise RuntimeError("the second run did not resume from the asynchronous checkpoint of step 4")
    return StepResult(rows=rows)


def step_checkpoint_memory(ctx: Context) -> StepResult:
    """Peak allocated memory above the state while CheckpointManager saves and loads, per low-bit optimizer (and
    AdamW as the float32 reference), synchronous and asynchronous: ``scripts/checkpoint_memory.py``, which fails
    when a rise exceeds its bound (about one quantized tensor in float32)."""
    names = ["AdamW", *low_bit_names()]
    names = [n for n in names if ctx.optimizers is None or n in ctx.optimizers]
    if not names:
        return StepResult(notes=["no AdamW or low-bit optimizer selected"])
    text = []
    for extra in ([], ["--async-save"]):
        command = [sys.executable, str(REPO_ROOT / "scripts" / "checkpoint_memory.py"), "--optimizers", ",".join(names)]
        command += extra + (["--dry-run"] if ctx.dry_run else [])
        done = _run_command(command, ctx)
        text.append(f"$ checkpoint_memory.py {' '.join(command[2:])}\n{done.output}")
        if not done.ok:
            raise RuntimeError("\n".join(text))
    return StepResult(text="\n".join(text))


def component_commands(out: Path) -> list[tuple[str, list[str]]]:
    """(what it checks, command) of the GPU checks that other parts of the project ship as their own scripts."""
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
        ),
        (
            "bf16 stochastic rounding: compiled on CUDA equals eager on CPU",
            [
                python,
                "-c",
                "import torch; from torchtitan.optim.state_storage import round_to_bfloat16_stochastically as r; "
                "x = torch.randn(1 << 20, device='cuda'); s = torch.tensor(7, device='cuda'); "
                "c = torch.compile(r, fullgraph=True, dynamic=False); "
                "assert torch.equal(c(x, s).cpu(), r(x.cpu(), s.cpu())); print('equal')",
            ],
        ),
        (
            "bf16 state rounding: speed on the GPU",
            [python, "benchmarks/bf16_momentum_rounding.py", "--speed-only", "cuda"],
        ),
        ("data loader: tokens/s per rank at 1 and 4 simulated ranks", [python, "benchmarks/bench_data_loader.py"]),
        (
            "Hugging Face export of a bf16 run, tied and scaled as Llama 3.2 is, with a fused RMSNorm and time-based "
            "pinned async saves",
            [python, *debug, "--job.dump_folder", hf_dump, "--model.norm_type", "fused_rmsnorm", *llama32]
            + ["--checkpoint.enable_checkpoint", "--checkpoint.interval_type", "seconds", "--checkpoint.interval", "1"]
            + ["--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.last_save_in_hf"]
            + ["--checkpoint.export_dtype", "bfloat16", "--training.gc_freq", "2"],
        ),
        (
            "Hugging Face import of that export, with a compiled RMSNorm",
            [python, *debug, "--job.dump_folder", hf_import_dump, "--model.norm_type", "compiled_rmsnorm", *llama32]
            + ["--checkpoint.initial_load_path", f"{hf_dump}/checkpoint/AdamW/step-4-hf"]
            + ["--checkpoint.initial_load_in_hf"],
        ),
    ]


def _hf_folders(out: Path) -> tuple[Path, Path]:
    """The dump folders of the component checks' Hugging Face export and import runs."""
    return out / "hf-roundtrip", out / "hf-roundtrip-import"


def step_component_checks(ctx: Context) -> StepResult:
    """The GPU checks of the chunked loss, bf16 state rounding, the data loader and Hugging Face weights, each its
    own command (listed, not run, in a dry run: they need CUDA); a command that fails or times out fails the step."""
    if not ctx.dry_run:
        for folder in _hf_folders(ctx.out):  # the export must not resume from an earlier gpu_check's checkpoints
            shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for what, command in component_commands(ctx.out):
        shown = " ".join(command[1:])
        if ctx.dry_run:
            rows.append({"check": what, "command": shown, "result": "listed (dry run)"})
            continue
        done = _run_command(command, ctx)
        tail = " / ".join(done.output.strip().splitlines()[-6:])
        rows.append({"check": what, "command": shown, "result": "ok" if done.ok else FAILED, "output": tail})
    return StepResult(rows=rows)


def step_gpu_tests(ctx: Context) -> StepResult:
    files = gpu_test_files()
    if ctx.dry_run:
        return StepResult(rows=[{"test file": f, "result": "listed (dry run)"} for f in files])
    done = _run_command([sys.executable, "-m", "pytest", "-q", "-rs", *files], ctx, timeout=PYTEST_TIMEOUT_S)
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
    """Run ``command`` in the repository root; past ``timeout`` seconds (default :data:`COMMAND_TIMEOUT_S`) it is
    killed and the result says so."""
    timeout = COMMAND_TIMEOUT_S if timeout is None else timeout
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=_env(ctx), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # What it printed so far (bytes on POSIX whatever ``text`` says).
        partial = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in (e.stdout, e.stderr))
        return _Done(None, f"{partial}\n(timed out after {timeout} s)", timeout)
    return _Done(done.returncode, done.stdout + done.stderr, timeout)


def _env(ctx: Context) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if ctx.dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    return env


# The plan, in order; add a step by writing a function of a Context returning a StepResult, and naming it here.
STEPS: dict[str, Callable[[Context], StepResult]] = {
    "optimizers_1b": step_optimizers_1b,
    "bench_optimizers": step_bench_optimizers,
    "llama3_8b": step_llama3_8b,
    "float8": step_float8,
    "async_checkpoint": step_async_checkpoint,
    "checkpoint_memory": step_checkpoint_memory,
    "component_checks": step_component_checks,
    "gpu_tests": step_gpu_tests,
}


# ----------------------------------------------------------------------------------------------------------------
# Running the plan and the report


def run_step(name: str, ctx: Context) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = STEPS[name](ctx)
        outcome = {"status": "ok", "rows": result.rows, "notes": result.notes, "text": result.text}
        broken = [
            row for row in result.rows if str(row.get("fits", "")).startswith("error") or row.get("result") == FAILED
        ]
        if broken:  # the other rows were still measured
            outcome.update(status="failed", error=f"{len(broken)} of {len(result.rows)} runs failed (see the table)")
    except Exception as e:  # noqa: BLE001 - one step failing must not stop the others
        outcome = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    _free(ctx.sizes.device)
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    print(f"gpu_check: {name}: {outcome['status']} in {outcome['seconds']} s", flush=True)
    return outcome


def device_description(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU (dry run)"
    props = torch.cuda.get_device_properties(device)
    return f"{torch.cuda.get_device_name(device)}, {props.total_memory / GIB:.0f} GiB"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check ({'dry run' if report['dry_run'] else 'GPU'})", ""]
    lines += [f"{report['device']}, torch {report['torch']}, {report['seconds']} s in all", ""]
    for name, step in report["steps"].items():
        lines += [f"## {name}: {step['status']} ({step['seconds']} s)", ""]
        if step["status"] != "ok":
            lines += ["```", step.get("error", ""), "```", ""]
        if "rows" not in step:
            continue
        lines += [f"- {note}" for note in step["notes"]] + ([""] if step["notes"] else [])
        if step["rows"]:
            columns = list(dict.fromkeys(k for row in step["rows"] for k in row))
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for row in step["rows"]:
                lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in columns) + " |")
            lines.append("")
        if step["text"]:
            lines += ["```", step["text"].rstrip(), "```", ""]
    return "\n".join(lines)


def run(out: Path, dry_run: bool, only: Optional[list[str]] = None, optimizers: Optional[list[str]] = None) -> dict:
    if not dry_run and not torch.cuda.is_available():
        raise UserError("no CUDA GPU found; run with --dry-run to check the plan on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    sizes = Sizes.for_run(dry_run)
    ctx = Context(sizes=sizes, out=out, dry_run=dry_run, optimizers=optimizers)
    started = time.perf_counter()
    with _dry_run_settings() if dry_run else contextlib.nullcontext():
        steps = {name: run_step(name, ctx) for name in (only or STEPS)}
    report = {
        "dry_run": dry_run,
        "device": device_description(sizes.device),
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "steps": steps,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    return report


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
    parser.add_argument("--only", default=None, help=f"comma-separated steps ({', '.join(STEPS)})")
    parser.add_argument("--optimizers", default=None, help="comma-separated registry names (default: all)")
    options = parser.parse_args(argv)
    only = _names(options.only, list(STEPS), "only")
    optimizers = _names(options.optimizers, list(OPTIMIZERS), "optimizers")
    report = run(Path(options.out), options.dry_run, only, optimizers)
    failed = [name for name, step in report["steps"].items() if step["status"] != "ok"]
    print(
        f"gpu_check: report in {Path(options.out) / 'gpu_check.md'}"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
