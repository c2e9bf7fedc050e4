"""Running the plan: each step in a process of its own, stopped at its budget, the report rewritten after every
step, SIGTERM ending the check with its processes."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from torchtitan.distributed.cuda_allocator import allocator_setting
from torchtitan.errors import UserError
from torchtitan.gpu_check.context import (
    COMPILE,
    DRY_RUN_BUDGET_S,
    FAILED,
    REPO_ROOT,
    Context,
    Sizes,
    compile_probe_code,
    dry_run_settings,
    imports_line,
    imports_path,
    log_path,
    missing_needs,
    result_json,
    result_path,
    run_command,
    skipped_text,
    step_env,
    wait_or_kill,
    write_atomically,
)
from torchtitan.gpu_check.steps import GROUPS, STEPS
from torchtitan.training.garbage_collection import collecting_only_new_objects

# ----------------------------------------------------------------------------------------------------------------
# Running the plan and the report


def _child_command(names: list[str], ctx: Context) -> list[str]:
    functions = [STEPS[name].run for name in names]
    command = [sys.executable, "-m", "torchtitan.tools.gpu_check", "--out", str(ctx.out), "--child", ",".join(names)]
    command += ["--step-function", ",".join(f"{f.__module__}:{f.__qualname__}" for f in functions)]
    command += ["--dry-run"] if ctx.dry_run else []
    command += ["--optimizers", ",".join(ctx.optimizers)] if ctx.optimizers else []
    return command


def step_budget(name: str, dry_run: bool) -> int:
    return DRY_RUN_BUDGET_S if dry_run else STEPS[name].budget_s


def _skipped(name: str, ctx: Context) -> Optional[dict[str, Any]]:
    """The outcome of a step that needs a package (or compiling) this machine lacks; None if it can run."""
    missing = missing_needs(STEPS[name].needs, ctx.found)
    if not missing:
        return None
    print(f"gpu_check: {name}: {skipped_text(missing)}", flush=True)
    return {"status": "skipped", "error": skipped_text(missing), "seconds": 0.0}


def _start(names: list[str], ctx: Context, budget: float, log: Path) -> Optional[int]:
    """Run ``names`` one after another in one process of their own, stopped at ``budget`` seconds; its exit code
    (None: stopped)."""
    for name in names:
        result_path(ctx.out, name).unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.Popen(
            _child_command(names, ctx),
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=step_env(ctx),
            start_new_session=True,
        )
        return wait_or_kill(process, budget)


def _outcome(name: str, ctx: Context, returncode: Optional[int], log: Path, budget: float) -> dict[str, Any]:
    """What step ``name`` measured and how it ended, from what its process saved."""
    saved = result_path(ctx.out, name)
    result = json.loads(saved.read_text()) if saved.is_file() else {}
    saved.unlink(missing_ok=True)
    outcome = {"status": "ok", "rows": result.get("rows", []), "notes": result.get("notes", [])}
    outcome["text"] = result.get("text", "")
    if "error" in result:
        outcome.update(status="failed", error=result["error"], traceback=result.get("traceback", ""))
    elif result.get("done"):
        broken = broken_rows(outcome["rows"])
        if broken:  # the other rows were still measured
            outcome.update(
                status="failed", error=f"{len(broken)} of {len(outcome['rows'])} runs failed (see the table)"
            )
    elif returncode is None:
        outcome.update(status="failed", error=f"stopped at its budget of {budget} s (what it measured is kept)")
    else:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        outcome.update(status="failed", error=f"its process exited with {returncode} before finishing:\n{tail}")
    if "seconds" in result:
        outcome["seconds"] = result["seconds"]
    outcome["budget s"] = budget
    return outcome


def _printed(name: str, outcome: dict[str, Any]) -> dict[str, Any]:
    print(
        f"gpu_check: {name}: {outcome['status']} in {outcome['seconds']} s (budget {outcome['budget s']} s)",
        flush=True,
    )
    return outcome


def run_step(name: str, ctx: Context) -> dict[str, Any]:
    """Run step ``name`` in a process of its own, stopped at its budget; what it measured, how it ended."""
    started = time.perf_counter()
    skipped = _skipped(name, ctx)
    if skipped is not None:
        return skipped
    budget = step_budget(name, ctx.dry_run)
    log = log_path(ctx.out, name)
    returncode = _start([name], ctx, budget, log)
    outcome = _outcome(name, ctx, returncode, log, budget)
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    return _printed(name, outcome)


def run_steps_together(names: list[str], ctx: Context) -> dict[str, dict[str, Any]]:
    """A dry run's steps one after another in one process (on the CPU, a process per step costs seconds of imports
    each and proves nothing more), stopped at one step's budget; each step's outcome, as :func:`run_step` gives it.
    Steps not reached (the process stopped first) are absent."""
    outcomes = {name: skipped for name in names if (skipped := _skipped(name, ctx)) is not None}
    runnable = [name for name in names if name not in outcomes]
    if not runnable:
        return outcomes
    budget = DRY_RUN_BUDGET_S
    log = log_path(ctx.out, "steps")
    returncode = _start(runnable, ctx, budget, log)
    for name in runnable:
        saved = result_path(ctx.out, name)
        ended = saved.is_file() and any(key in json.loads(saved.read_text()) for key in ("done", "error"))
        outcome = _outcome(name, ctx, returncode, log, budget)
        outcome.setdefault("seconds", 0.0)
        outcomes[name] = _printed(name, outcome)
        if not ended:  # the step the process stopped in (at its budget, or crashing); the next were not reached
            break
    return outcomes


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
    started = time.perf_counter()
    saved = result_path(ctx.out, name)
    try:
        with dry_run_settings() if ctx.dry_run else contextlib.nullcontext(), collecting_only_new_objects():
            result = step(ctx)
    except Exception as e:  # noqa: BLE001 - the parent reports it as this step's failure
        partial = json.loads(saved.read_text()) if saved.is_file() else {}
        partial.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        partial["seconds"] = round(time.perf_counter() - started, 1)
        write_atomically(saved, json.dumps(partial, default=str))
        traceback.print_exc()
        return 1
    seconds = round(time.perf_counter() - started, 1)
    write_atomically(saved, json.dumps({**result_json(result), "done": True, "seconds": seconds}, default=str))
    return 0


def run_children(names: str, functions: str, ctx: Context) -> int:
    """The body of a process running steps ``names`` (comma-separated, with their ``functions``) in turn; a step
    that fails does not stop the next."""
    codes = [run_child(name, function, ctx) for name, function in zip(names.split(","), functions.split(","))]
    return max(codes, default=0)


def probe_imports(ctx: Context) -> dict[str, Optional[str]]:
    """:func:`importable` in a process started as the steps are (the parent keeps CUDA untouched)."""
    code = "import json; from torchtitan.gpu_check.context import importable; print(json.dumps(importable()))"
    done = run_command([sys.executable, "-c", code], ctx, timeout=120)
    if not done.ok:
        raise RuntimeError(f"the import probe {done.how_it_ended()}:\n{done.output[-2000:]}")
    return json.loads(done.output.strip().splitlines()[-1])


def probe_compile(ctx: Context) -> tuple[Optional[str], str]:
    """Whether a tiny ``torch.compile`` runs on the check's device ("yes", else None), in a process of its own, and
    the one line that says so; where it cannot, the steps that compile are skipped and the optimizer rows run their
    foreach implementation, so the loan is still spent on what can run."""
    done = run_command([sys.executable, "-c", compile_probe_code(ctx.sizes.device.type)], ctx, timeout=120)
    if done.ok:
        return "yes", f"gpu_check: torch.compile works on {ctx.sizes.device.type}"
    lines = [line.strip() for line in done.output.splitlines() if line.strip()]
    reason = lines[-1] if lines else done.how_it_ended()
    return None, (
        f"gpu_check: this machine cannot compile ({reason[:200]}); the steps that compile are skipped and the "
        "optimizer rows run with implementation foreach"
    )


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
    lines += [f"- {report['imports']}", f"- {report['compile']}", f"- allocator: {report['allocator']}", ""]
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
    write_atomically(out / "gpu_check.json", json.dumps(report, indent=1, default=str))
    write_atomically(out / "gpu_check.md", markdown(report))


def run(
    out: Path,
    dry_run: bool,
    only: Optional[list[str]] = None,
    optimizers: Optional[list[str]] = None,
    together: Optional[bool] = None,
) -> dict:
    """Run the plan (or the steps ``only``), each step in a process of its own; ``together`` (default: in a dry
    run) runs them one after another in one process."""
    if not dry_run and not torch.cuda.is_available():
        raise UserError("no CUDA GPU found; run with --dry-run to check the plan on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(sizes=Sizes.for_run(dry_run), out=out, dry_run=dry_run, optimizers=optimizers)
    started = time.perf_counter()
    ctx.found = probe_imports(ctx)
    write_atomically(imports_path(out), json.dumps(ctx.found))
    line = imports_line(ctx.found)
    print(line, flush=True)
    ctx.found[COMPILE], compile_line = probe_compile(ctx)
    print(compile_line, flush=True)
    write_atomically(imports_path(out), json.dumps(ctx.found))  # the steps read both probes
    names = only or list(STEPS)
    report = {
        "dry_run": dry_run,
        "device": device_description(dry_run),
        "torch": torch.__version__,
        "imports": line,
        "compile": compile_line,
        "allocator": allocator_setting(step_env(ctx)),
        "seconds": 0.0,
        "steps": {name: {"status": "not run yet"} for name in names},
    }
    write_report(out, report)
    with _ended_by_sigterm():
        if together if together is not None else dry_run:
            try:
                report["steps"].update(run_steps_together(names, ctx))
            except _Ended as e:  # the finished steps' results are kept; the one running is failed
                _ended_together(names, ctx, report, str(e))
            report["seconds"] = round(time.perf_counter() - started, 1)
            write_report(out, report)
            names = []
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


def _ended_together(names: list[str], ctx: Context, report: dict[str, Any], signal_name: str) -> None:
    """The steps run together were ended: those that finished keep their outcome, the first that did not fails."""
    for name in names:
        saved = result_path(ctx.out, name)
        partial = json.loads(saved.read_text()) if saved.is_file() else {}
        if partial.get("done"):
            report["steps"][name] = _outcome(name, ctx, 0, log_path(ctx.out, "steps"), DRY_RUN_BUDGET_S)
            continue
        error = f"the check was ended ({signal_name}) during this step"
        report["steps"][name] = {**partial, "status": "failed", "error": error}
        break
    report["ended"] = signal_name


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


def names_of(value: Optional[str], valid: list[str], what: str) -> Optional[list[str]]:
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise UserError(f"--{what}: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(valid)}")
    return names
