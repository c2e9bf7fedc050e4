"""The GPU check's steps, each a function of a :class:`~torchtitan.gpu_check.context.Context` returning a
:class:`~torchtitan.gpu_check.context.StepResult`, and the plan: :data:`STEPS` with their estimates and budgets, and
:data:`GROUPS`, each one device command."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from torchtitan.distributed.cuda_allocator import allocator_setting
from torchtitan.errors import UserError
from torchtitan.gpu_check.context import (
    COMPILE,
    FAILED,
    PYTEST_TIMEOUT_S,
    QUICK_8B,
    QUICK_OPTIMIZERS,
    REPO_ROOT,
    TRAIN_PY_NEEDS,
    Context,
    Done,
    Sizes,
    StepResult,
    as_run_here,
    low_bit_names,
    missing_needs,
    optimizer_needs,
    optimizer_specs,
    run_command,
    skipped_text,
)
from torchtitan.gpu_check.measure import build, estimates, free_memory, is_oom, train
from torchtitan.gpu_check.seed_run import step_seed_run_8b


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
    for spec in as_run_here(specs, ctx.found):
        missing = missing_needs(optimizer_needs(spec), ctx.found)
        if missing:
            rows.append({"optimizer": spec, "fits": skipped_text(missing)})
        else:
            runnable.append(spec)
    try:
        built = build(sizes, flavor, *extra)
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
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
        trained[spec] = train(built, spec, sizes, steps)
        rows.append(trained[spec])
        ctx.save(result)
    job = built.job
    del built
    free_memory(sizes.device)
    if not estimate or not trained:
        return result
    estimated = estimates(job, list(trained))
    for spec, row in trained.items():
        found = estimated.get(spec, {})
        row["estimated peak allocated GiB"] = found.get("GiB")
        row["estimated peak reserved GiB"] = found.get("reserved GiB")
        measured, reserved = row.get("peak reserved GiB"), found.get("reserved GiB")
        if measured and reserved:
            row["reserved estimate error %"] = round(100 * (reserved - measured) / measured, 1)
        if "error" in found:
            row["estimate"] = f"error: {found['error']}"
        elif found.get("implementation") != row["implementation"]:  # the estimate must be of the same step
            row["estimate"] = f"error: simulated {found.get('implementation')}"
    result.notes.append(
        "estimated peak allocated and reserved: estimation.py's simulation of the same job (one rank, the same "
        "optimizer step implementation; reserved by its caching-allocator model under this process's allocator "
        "setting)"
    )
    return result


def _compile_args(sizes: Sizes) -> tuple[str, ...]:
    return ("--training.compile", str(sizes.compile).lower())


def step_adam_mini_step_1b(ctx: Context) -> StepResult:
    """Adam-mini's fused step against fused AdamW's (``benchmarks/bench_optimizers.py``): float32 at ~100M and ~1B,
    where its one-pass operator steps every tensor in one Triton launch (time and CUDA kernels a step), and bf16
    weights at ~1B (compiled graphs)."""
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
    )


_8B_EXTRA = ("--activation_checkpoint.mode", "full")


def _rows_8b(ctx: Context, specs: list[str]) -> StepResult:
    sizes = ctx.sizes
    return _optimizer_rows(ctx, specs, sizes.large_flavor, *_8B_EXTRA, estimate=sizes.estimate_large, steps=(1, 2))


def step_llama3_8b(ctx: Context) -> StepResult:
    return _rows_8b(ctx, ctx.selected(QUICK_8B))


def llama3_8b_more_specs() -> list[str]:
    """The registry's optimizers that the quick profile does not run at 8B."""
    quick = {s.split(":")[0] for s in QUICK_8B}
    return [s for s in optimizer_specs() if ":" not in s and s not in quick]


def step_llama3_8b_more(ctx: Context) -> StepResult:
    return _rows_8b(ctx, ctx.selected(llama3_8b_more_specs()))


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
        free_memory(ctx.sizes.device)
    return StepResult(text="\n".join(text))


def bench_optimizer_names(ctx: Context) -> list[str]:
    """The registry names ``bench_optimizers.py --optimizers`` gets: those it times that are selected and can be
    built here."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.bench_optimizers import FAMILIES

    return [n for n in ctx.selected(FAMILIES) if not missing_needs(optimizer_needs(n), ctx.found)]


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
        built = build(
            sizes, sizes.small_flavor, "--float8.enable_float8_linear", str(enabled).lower(), *_compile_args(sizes)
        )
        result.rows.append({**row, **train(built, "AdamW", sizes)})
        ctx.save(result)
        del built
        free_memory(sizes.device)
    return result


def debug_train_args(ctx: Context, dump: Path, *args: str) -> list[str]:
    """train.py's arguments for the debug model at this check's sizes, dumping into ``dump``, with ``args``."""
    config = REPO_ROOT / "train_configs" / "debug_model.toml"
    return ["--job.config_file", str(config), "--job.dump_folder", str(dump), *ctx.sizes.train_overrides, *args]


def step_async_checkpoint(ctx: Context) -> StepResult:
    """train.py saves asynchronously at steps 2 and 4; a second run resumes from step 4 and trains to 6."""
    dump = ctx.out / "async_checkpoint"
    shutil.rmtree(dump, ignore_errors=True)  # the first run must not resume from an earlier gpu_check's checkpoints
    common = debug_train_args(
        ctx,
        dump,
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
    )
    result = StepResult()
    rows = result.rows
    for steps in (4, 6):
        started = time.perf_counter()
        done = run_script(ctx, "train.py", [*common, "--training.steps", str(steps)])
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


def step_health_timing(ctx: Context) -> StepResult:
    """``train.py`` on the debug model with optimizer health every 2 steps: the health tags and the step-time split
    (CUDA events, no synchronisation per step) it logs; then ``benchmarks/bench_health.py``'s overhead ratio at the
    default health frequency."""
    import json

    dump = ctx.out / "health_timing"
    shutil.rmtree(dump, ignore_errors=True)
    steps = 4 if ctx.dry_run else 12
    command = debug_train_args(
        ctx,
        dump,
        "--training.steps",
        str(steps),
        "--training.warmup_steps",
        "1",
        "--metrics.log_freq",
        "2",
        "--metrics.health_freq",
        "2",
    )
    done = run_script(ctx, "train.py", command)
    if not done.ok:
        raise RuntimeError(f"train.py {done.how_it_ended()}:\n{done.output[-3000:]}")
    (metrics_file,) = (dump / "tb").glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    last = {k: v for row in rows if row["step"] == steps for k, v in row.items()}
    result = StepResult()
    times = {k: v for k, v in last.items() if k.startswith("time/")}
    health = sorted(k for k in last if k.startswith("health/"))
    if not times or "health/attn_logit_max" not in last or "health/update_rms/all" not in last:
        raise RuntimeError(f"train.py did not log the step-time split and health at step {steps}: {sorted(last)}")
    result.rows.append(
        {
            "step": steps,
            **{k.removeprefix("time/").removesuffix("(s)") + " (ms/step)": round(v * 1e3, 2) for k, v in times.items()},
            "health tags": len(health),
            "attn_logit_max": round(last["health/attn_logit_max"], 3),
            "update_rms/all": f"{last['health/update_rms/all']:.3e}",
        }
    )
    ctx.save(result)
    bench = ["--rounds", "1", "--device", "cpu", *ctx.sizes.train_overrides] if ctx.dry_run else ["--rounds", "20"]
    done = run_script(ctx, "benchmarks/bench_health.py", bench)
    result.text = f"$ bench_health.py {' '.join(bench)}\n{done.output}"
    if not done.ok:
        raise RuntimeError(result.text)
    return result


def run_script(ctx: Context, script: str, args: list[str]) -> Done:
    """``python3 SCRIPT ARGS`` in the repository root (``script`` relative to it); in a dry run the script's entry in
    this process (``train.py``'s ``run()`` on its command line, a tool's ``main(args)``), its output captured: on
    the CPU a process of its own costs seconds of imports and proves nothing more."""
    if not ctx.dry_run:
        return run_command([sys.executable, str(REPO_ROOT / script), *args], ctx)
    import importlib
    from unittest import mock

    sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        with mock.patch.object(sys, "argv", [str(REPO_ROOT / script), *args]):
            try:
                code = module.run() if script == "train.py" else module.main(args)
            except SystemExit as e:
                code = e.code
    return Done(code, captured.getvalue(), 0)


def step_checkpoint_memory(ctx: Context) -> StepResult:
    """Peak allocated memory above the state while CheckpointManager saves and loads, per low-bit optimizer (and
    AdamW as the float32 reference), synchronous and asynchronous: ``scripts/checkpoint_memory.py``, which fails
    when a rise exceeds its bound (derived from the optimizer's largest state tensor)."""
    names = ctx.selected(["AdamW", *low_bit_names()])
    notes = [
        f"{n}: {skipped_text(missing_needs(optimizer_needs(n), ctx.found))}"
        for n in names
        if missing_needs(optimizer_needs(n), ctx.found)
    ]
    names = [n for n in names if not missing_needs(optimizer_needs(n), ctx.found)]
    if not names:
        return StepResult(notes=notes or ["no AdamW or low-bit optimizer selected"])
    text = []
    for extra in ([], ["--async-save"]):
        args = ["--optimizers", ",".join(names), *extra, *(["--dry-run"] if ctx.dry_run else [])]
        done = run_script(ctx, "scripts/checkpoint_memory.py", args)
        text.append(f"$ checkpoint_memory.py {' '.join(args)}\n{done.output}")
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
        missing = missing_needs(needs, ctx.found)
        if ctx.dry_run:
            result.rows.append({"check": what, "command": shown, "result": "listed (dry run)"})
            continue
        if missing:
            result.rows.append({"check": what, "command": shown, "result": skipped_text(missing)})
            continue
        done = run_command(command, ctx)
        tail = " / ".join(done.output.strip().splitlines()[-6:])
        result.rows.append({"check": what, "command": shown, "result": "ok" if done.ok else FAILED, "output": tail})
        ctx.save(result)
    return result


def step_gpu_tests(ctx: Context) -> StepResult:
    files = gpu_test_files()
    if ctx.dry_run:
        return StepResult(rows=[{"test file": f, "result": "listed (dry run)"} for f in files])
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    done = run_command(command, ctx, timeout=PYTEST_TIMEOUT_S)
    tail = "\n".join(done.output.splitlines()[-30:])
    if not done.ok:
        raise RuntimeError(f"pytest {done.how_it_ended()}:\n{tail}")
    return StepResult(text=tail)


def gpu_test_files() -> list[str]:
    """Test files that skip themselves without CUDA."""
    found = []
    for path in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "skipif" in text and "cuda.is_available()" in text:
            found.append(str(path.relative_to(REPO_ROOT)))
    return found


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
    "adam_mini_step_1b": Step(step_adam_mini_step_1b, estimate_s=95, budget_s=135, needs=(COMPILE,)),
    "optimizers_1b": Step(step_optimizers_1b, estimate_s=160, budget_s=200),
    "llama3_8b": Step(step_llama3_8b, estimate_s=130, budget_s=163),
    "optimizers_1b_variants": Step(step_optimizers_1b_variants, estimate_s=180, budget_s=250),
    "optimizers_1b_more": Step(step_optimizers_1b_more, estimate_s=240, budget_s=300, needs=("torchao",)),
    "llama3_8b_more": Step(step_llama3_8b_more, estimate_s=240, budget_s=300),
    "compiled_1b": Step(step_compiled_1b, estimate_s=180, budget_s=250, needs=(COMPILE,)),
    "bench_optimizers_100m": Step(step_bench_optimizers_100m, estimate_s=200, budget_s=260, needs=(COMPILE,)),
    "bench_optimizers_1b": Step(step_bench_optimizers_1b, estimate_s=240, budget_s=300, needs=(COMPILE,)),
    "float8": Step(step_float8, estimate_s=200, budget_s=250, needs=(COMPILE,)),
    "async_checkpoint": Step(step_async_checkpoint, estimate_s=70, budget_s=120, needs=TRAIN_PY_NEEDS),
    "checkpoint_memory": Step(step_checkpoint_memory, estimate_s=120, budget_s=180),
    "component_checks": Step(step_component_checks, estimate_s=300, budget_s=500),
    "gpu_tests": Step(step_gpu_tests, estimate_s=360, budget_s=450, needs=("pytest", "torchdata")),
    "health_timing": Step(step_health_timing, estimate_s=60, budget_s=100, needs=(*TRAIN_PY_NEEDS, COMPILE)),
    "seed_run_8b": Step(step_seed_run_8b, estimate_s=270, budget_s=340, needs=(COMPILE,)),
}
# Every budget leaves at least this much over its estimate (a loaded or slower machine, a colder cache).
BUDGET_HEADROOM = 1.25
# Groups of steps, each one device command of at most 9 minutes by the estimates (10 by the budgets, a command's
# limit); together every step once. ``--quick`` is "quick".
GROUPS: dict[str, tuple[str, ...]] = {
    "quick": ("adam_mini_step_1b", "optimizers_1b", "llama3_8b"),
    "optimizers": ("optimizers_1b_variants", "optimizers_1b_more"),
    "large": ("llama3_8b_more", "compiled_1b"),
    "bench": ("bench_optimizers_100m", "bench_optimizers_1b"),
    "training": ("float8", "async_checkpoint", "checkpoint_memory"),
    "components": ("component_checks",),
    "tests": ("gpu_tests", "health_timing"),
    # Right after --quick: the seed run's reserved memory, measured (it does not fit the quick profile's command).
    "seed_run": ("seed_run_8b",),
}
STARTUP_S = 30  # the check's own start, the import probe and the compile probe, before the first step


def group_seconds(steps: tuple[str, ...] | list[str], budget: bool = False) -> int:
    return STARTUP_S + sum(STEPS[s].budget_s if budget else STEPS[s].estimate_s for s in steps)
