"""scripts/gpu_check.sh: its dry run (the GPU plan on the CPU with tiny shapes) runs every step, each in its own
process within its budget; the plan follows the optimizer registry, fits its device commands, keeps going when a
step fails, hangs or lacks a package, and rewrites its report after every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests import processes
from tests.distributed import launch_env
from tests.helpers import ROOT
from torchtitan.distributed.cuda_allocator import DEFAULT_ALLOC_CONF
from torchtitan.errors import UserError
from torchtitan.gpu_check import context, runner, seed_run
from torchtitan.gpu_check import steps as plan
from torchtitan.optim.builder import OPTIMIZERS
from torchtitan.tools import gpu_check

OPTIMIZER_STEPS_1B = ("optimizers_1b", "optimizers_1b_variants", "optimizers_1b_more")


def test_dry_run_runs_every_step_and_writes_the_report(tmp_path):
    """The one run of every step's own code (each optimizer trained and estimated as the GPU check does, its
    train.py and script commands, the report), which no GPU run of the suite can do: the plan kept from rotting
    between loans of a GPU. The runner's handling of failing, hanging and unequipped steps is the made-up steps'
    tests below."""
    out = tmp_path / "report"
    # The device has python3 only: a `python` that fails shows the check never calls it.
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python").write_text("#!/bin/sh\nexit 97\n")
    (shims / "python").chmod(0o755)
    env = launch_env(cpu=True, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}", PYTHONPATH="/elsewhere/site")
    done = processes.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)], env=env, timeout=840)
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {name: step.get("error") for name, step in report["steps"].items() if step["status"] != "ok"}
    assert failed == {} and done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("gpu_check: imports present: torch ")
    assert list(report["steps"]) == list(plan.STEPS)
    trained = [row["optimizer"] for name in OPTIMIZER_STEPS_1B for row in report["steps"][name]["rows"]]
    assert sorted(trained) == sorted(context.optimizer_specs())
    for name in OPTIMIZER_STEPS_1B:
        for row in report["steps"][name]["rows"]:
            assert row["fits"] == "yes" and row["estimated peak allocated GiB"] is not None, row
            assert "estimate" not in row, row  # the estimate simulated the implementation the run took
    large_rows = [row for name in ("llama3_8b", "llama3_8b_more") for row in report["steps"][name]["rows"]]
    large = [row["optimizer"] for row in large_rows]
    assert sorted(large) == sorted(context.QUICK_8B + tuple(plan.llama3_8b_more_specs()))
    # The dry run's 8B model is the 1B steps' tiny one: each optimizer trains there too, estimated in the 1B steps.
    assert all(row["fits"] == "yes" and "estimated peak allocated GiB" not in row for row in large_rows), large_rows
    assert context.Sizes.for_run(dry_run=False).estimate_large  # on a GPU, the 8B rows are estimated
    assert {s.split(":")[0] for s in large} == set(OPTIMIZERS)
    # Compiled blocks are estimated as compiled: the compiled step has its estimates too.
    assert all(row["estimated peak allocated GiB"] is not None for row in report["steps"]["compiled_1b"]["rows"])
    assert report["steps"]["async_checkpoint"]["rows"][1]["resumed from step 4"] is True
    saved = report["steps"]["checkpoint_memory"]["text"]
    assert "AdamMini4bit" in context.low_bit_names() and "--async-save" in saved
    for name in ["AdamW", *context.low_bit_names()]:
        assert saved.count(f"\n{name} ") == 2, saved  # a table row in the synchronous and the asynchronous run
    assert "AdamW (fused)" in report["steps"]["adam_mini_step_1b"]["text"]
    assert "AdamMini (fused)" in report["steps"]["adam_mini_step_1b"]["text"]
    assert "Muon (bf16 NS)" in report["steps"]["bench_optimizers_100m"]["text"]
    listed = [row["result"] for row in report["steps"]["component_checks"]["rows"]]
    assert listed == ["listed (dry run)"] * len(plan.component_commands(out))
    markdown = (out / "gpu_check.md").read_text()
    for name in plan.STEPS:
        assert f"## {name}: ok" in markdown
    # The seed run's rank: each optimizer under train.py's allocator setting and torch's defaults, beside the
    # estimate of the same job and the seed run's measurement (peaks are None on the CPU).
    seed_rows = report["steps"]["seed_run_8b"]["rows"]
    assert [(row["optimizer"], row["allocator"]) for row in seed_rows] == [
        (name, allocator)
        for allocator in (DEFAULT_ALLOC_CONF, seed_run.TORCH_DEFAULTS)
        for name in seed_run.SEED_RUN_OPTIMIZERS
    ]
    for row in seed_rows:
        assert row["fits"] == "yes" and row["steps"] == seed_run.SEED_RUN_STEPS, row
        assert row["estimated peak allocated GiB"] is not None and "peak reserved GiB" in row, row
        assert row["seed run reserved GiB"] == seed_run.SEED_RUN_RESERVED_GIB[row["optimizer"]]
    assert "| AdamMini | torch's defaults |" in markdown
    assert report["allocator"] == f"PYTORCH_CUDA_ALLOC_CONF={DEFAULT_ALLOC_CONF}"
    assert not list((out / "steps").glob("*.json.partial"))


def test_snapshot_summary_per_stream():
    """``torch.cuda.memory._snapshot()``'s segments summed per stream; the largest free block is the largest
    inactive block of any of its segments (not the sum of free bytes, which fragmentation scatters)."""
    mib = 2**20

    def segment(stream, total, blocks):
        allocated = sum(size for size, state in blocks if state == "active_allocated")
        return {
            "stream": stream,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "segment_type": "large",
            "blocks": [{"size": size, "state": state, "address": 0, "requested_size": size} for size, state in blocks],
        }

    snapshot = {
        "segments": [
            segment(0, 100 * mib, [(60 * mib, "active_allocated"), (40 * mib, "inactive")]),
            segment(0, 2 * mib, [(1 * mib, "active_allocated"), (1 * mib, "inactive")]),
            segment(0x7F00, 1024 * mib, [(1000 * mib, "active_allocated"), (24 * mib, "active_awaiting_free")]),
        ],
        "device_traces": [],
    }
    assert seed_run.summarize_snapshot(snapshot) == [
        {
            "stream": "0x7f00",
            "segments": 1,
            "reserved GiB": 1.0,
            "allocated GiB": 0.98,
            "free GiB": 0.02,
            "largest free block MiB": 0.0,  # a block awaiting another stream is not free yet
        },
        {
            "stream": "default",
            "segments": 2,
            "reserved GiB": 0.1,
            "allocated GiB": 0.06,
            "free GiB": 0.04,
            "largest free block MiB": 40.0,
        },
    ]
    assert seed_run.summarize_snapshot({"segments": []}) == []


def test_phase_peaks_name_each_peaks_phase_and_keep_the_reserved_peaks_snapshot(monkeypatch):
    """On a GPU: each phase's peaks (the counters reset between phases), the phase of each overall peak, and the
    allocator's snapshot from the end of the first phase that reached the reserved peak."""
    gib = 2**30
    peaks = iter([(5, 10), (8, 10), (7, 12), (3, 12)])  # (allocated, reserved) GiB of each phase, in turn
    now: dict[str, int] = {}

    def read_peaks():
        now["allocated"], now["reserved"] = (value * gib for value in next(peaks))

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: now["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: now["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: now["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"taken after": now["reserved"] // gib})
    recorder = seed_run.PhasePeaks(torch.device("cuda"))
    for phase in ("build", "forward (step 1)", "optimizer step (step 1)", "forward (step 2)"):
        recorder.begin(phase)
        read_peaks()
    recorder.end()
    assert recorder.summary() == {
        "peak reserved GiB": 12.0,
        "reserved peak during": "optimizer step (step 1)",
        "peak allocated GiB": 8.0,
        "allocated peak during": "forward (step 1)",
    }
    assert recorder.snapshot_phase == "optimizer step (step 1)" and recorder.snapshot == {"taken after": 12}
    assert seed_run.PhasePeaks(torch.device("cpu")).summary()["peak reserved GiB"] is None  # nothing on a CPU


def test_seed_run_rows_beside_the_estimate_of_their_allocator_setting():
    from torchtitan.estimation.allocator import Replay, parse_alloc_conf

    gib = 2**30

    def estimate(allocated, expandable, default):
        reserved = [Replay(parse_alloc_conf("expandable_segments:True"), expandable * gib, "backward (step 1)")]
        reserved.append(Replay(parse_alloc_conf(""), default * gib, "optimizer step (step 2)"))
        return SimpleNamespace(peak=allocated * gib, reserved=reserved)

    estimates = {"AdamW": estimate(62, 72, 79), "AdamMini": estimate(58, 68, 77)}
    rows = []
    for conf, measured in (("expandable_segments:True", (70, 66)), ("", (75, 69))):
        for name, reserved in zip(seed_run.SEED_RUN_OPTIMIZERS, measured):
            row = {"optimizer": name, "allocator": conf or seed_run.TORCH_DEFAULTS, "fits": "yes"}
            row.update({"peak reserved GiB": reserved, "peak allocated GiB": 60})
            seed_run._compare(row, estimates[name], conf)
            rows.append(row)
    assert rows[0]["estimated peak reserved GiB"] == 72 and rows[0]["reserved estimate error %"] == 2.9
    assert rows[2]["estimated peak reserved GiB"] == 79 and rows[2]["reserved estimate error %"] == 5.3
    assert rows[2]["estimated reserved peak during"] == "optimizer step (step 2)"
    assert rows[1]["estimated peak allocated GiB"] == 58 and rows[1]["allocated estimate error %"] == -3.3
    assert seed_run._savings(rows) == [
        "AdamW minus AdamMini, peak reserved, expandable_segments:True: measured 4 GiB, estimated 4.0 GiB, seed run "
        "6.19 GiB",
        "AdamW minus AdamMini, peak reserved, torch's defaults: measured 6 GiB, estimated 2.0 GiB, seed run 6.19 GiB",
    ]
    rows[3]["fits"] = "no: out of memory during backward (step 1) within 79.2 GiB"
    assert len(seed_run._savings(rows)) == 1  # no saving where one run did not fit


def test_a_seed_run_process_that_fails_is_its_rows_error_with_its_output_kept(tmp_path):
    """On a GPU each measurement is ``python -m torchtitan.gpu_check.seed_run`` in a process of its own; here, without
    CUDA, it fails, and its row says so in one cell while its whole output is kept in the check's logs."""
    ctx = context.Context(sizes=context.Sizes.for_run(dry_run=True), out=tmp_path, dry_run=False)
    env = {**context.step_environment(False), "CUDA_VISIBLE_DEVICES": ""}
    measured = seed_run._measure_in_a_process(ctx, "AdamW", "expandable_segments:True", env)
    assert measured["row"]["fits"].startswith("error: its process exited with 1: "), measured
    log = (tmp_path / "logs" / "seed_run_8b" / "AdamW-expandable_segments_True.log").read_text()
    assert "Traceback" in log and "--optimizer" not in measured["row"]["fits"]
    assert runner.broken_rows([measured["row"]])  # the step fails, its other rows still measured


def test_seed_run_measures_under_the_launchers_setting_then_torchs_defaults():
    launcher = context.step_environment(False, {"PATH": "/bin"})
    (first, first_env), (second, second_env) = seed_run.allocator_settings(launcher)
    assert (first, first_env["PYTORCH_CUDA_ALLOC_CONF"]) == (DEFAULT_ALLOC_CONF, DEFAULT_ALLOC_CONF)
    assert second == "" and "PYTORCH_CUDA_ALLOC_CONF" not in second_env and second_env["PATH"] == "/bin"
    own = context.step_environment(False, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"})
    assert [conf for conf, _ in seed_run.allocator_settings(own)] == ["max_split_size_mb:512", ""]
    # A user who chose torch's defaults is measured once.
    assert [conf for conf, _ in seed_run.allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": ""})] == [""]


def test_plan_follows_the_registry():
    specs = context.optimizer_specs()
    assert [s for s in specs if ":" not in s] == list(OPTIMIZERS)  # a new optimizer appears without edits here
    for variant in ("AdamW:implementation=fused", "AdamMini:implementation=foreach", "AdamMini:state_dtype=bfloat16"):
        assert variant in specs
    assert context.optimizer_specs(["AdamMini4bit"]) == ["AdamMini4bit"]
    # The three 1B steps run every spec once; a new registry name lands in one of them.
    at_1b = [
        *context.QUICK_OPTIMIZERS,
        *plan.optimizers_1b_variant_specs(),
        *plan.optimizers_1b_more_specs(),
    ]
    assert sorted(at_1b) == sorted(specs)
    at_8b = [s.split(":")[0] for s in context.QUICK_8B] + plan.llama3_8b_more_specs()
    assert set(at_8b) == set(OPTIMIZERS)
    assert "tests/estimation/test_estimation_cuda.py" in plan.gpu_test_files()
    # The component checks name scripts that exist (the list cannot outlive a renamed benchmark).
    scripts = [command[1] for _, command, _ in plan.component_commands(ROOT) if command[1].endswith(".py")]
    assert "benchmarks/bench_loss.py" in scripts and "train.py" in scripts
    assert all((ROOT / script).is_file() for script in scripts), scripts


def test_groups_cover_the_plan_and_each_fits_one_device_command():
    grouped = [step for steps in plan.GROUPS.values() for step in steps]
    assert sorted(grouped) == sorted(plan.STEPS)  # every step in exactly one group
    for name, steps in plan.GROUPS.items():
        assert plan.group_seconds(steps) <= 9 * 60, name  # by the estimates
        assert plan.group_seconds(steps, budget=True) <= 10 * 60, name  # by the budgets: a command's limit
        # A quarter over each estimate at least: a loaded or slower machine, a colder cache.
        assert plan.BUDGET_HEADROOM >= 1.25
        assert all(plan.STEPS[s].budget_s >= plan.BUDGET_HEADROOM * plan.STEPS[s].estimate_s for s in steps), name
    assert plan.group_seconds(plan.GROUPS["quick"]) <= 8 * 60
    assert runner.steps_of("quick,gpu_tests") == [*plan.GROUPS["quick"], "gpu_tests"]
    # docs/gpu-check.md gives each step's estimate as the plan has it.
    docs = (ROOT / "docs" / "gpu-check.md").read_text()
    for name, step in plan.STEPS.items():
        assert f"| `{name}` | {step.estimate_s} s | {step.budget_s} s |" in docs, name
    for name in plan.GROUPS:
        assert f"--only {name}" in docs or (name == "quick" and "--quick" in docs)


def test_steps_run_with_the_trainers_allocator_and_an_extended_pythonpath():
    env = context.step_environment(False, {"PYTHONPATH": "/tmp/site", "PATH": "/bin"})
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/tmp/site"  # wheels installed beside the project stay visible
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_ALLOC_CONF and "CUDA_VISIBLE_DEVICES" not in env
    kept = context.step_environment(False, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in kept and kept["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert kept["PYTHONPATH"] == str(ROOT)


# Steps for the tests below; each runs in a process of its own, which imports this module to find it.
def fine_step(ctx):
    return context.StepResult(rows=[{"checked": "yes"}])


def broken_step(ctx):
    ctx.save(context.StepResult(rows=[{"measured": "before breaking"}]))
    raise RuntimeError("broken on purpose")


def hanging_step(ctx):
    """Saves what the report said while it runs (the earlier steps' results) and the id of a process it started in a
    session of its own, then hangs past its budget."""
    report = json.loads((ctx.out / "gpu_check.json").read_text())
    seen = {name: step["status"] for name, step in report["steps"].items()}
    started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    ctx.save(context.StepResult(rows=[{"report while running": json.dumps(seen), "started": started.pid}]))
    time.sleep(600)


def rows_as_run_here(ctx):
    specs = [
        "AdamW",
        "AdamW:implementation=fused",
        "AdamMini:implementation=fused:state_dtype=bfloat16",
        "Muon",
        "SOAP",
    ]
    return context.StepResult(rows=[{"spec": spec} for spec in context.as_run_here(specs, ctx.found)])


def test_a_machine_that_cannot_compile_says_so_in_one_line_and_runs_its_rows_foreach(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        runner,
        "STEPS",
        {"compiles": plan.Step(fine_step, 1, 2, needs=(context.COMPILE,)), "rows": plan.Step(rows_as_run_here, 1, 2)},
    )
    monkeypatch.setattr(runner, "step_budget", lambda name, dry_run: 120)
    monkeypatch.setattr(runner, "probe_imports", lambda ctx: {"torch": torch.__version__})
    # The probe's process fails as Triton does without a C compiler.
    monkeypatch.setattr(runner, "compile_probe_code", lambda device: "raise SystemExit('Failed to find C compiler')")
    report = runner.run(tmp_path, dry_run=True)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("gpu_check: this machine")]
    assert line == (
        "gpu_check: this machine cannot compile (Failed to find C compiler); the steps that compile are skipped and "
        "the optimizer rows run with implementation foreach"
    )
    assert report["steps"]["compiles"]["status"] == "skipped"
    assert "this machine cannot compile" in report["steps"]["compiles"]["error"]
    specs = [row["spec"] for row in report["steps"]["rows"]["rows"]]
    assert specs == [
        "AdamW:implementation=foreach",
        "AdamMini:state_dtype=bfloat16:implementation=foreach",
        "Muon:implementation=foreach",
        "SOAP:implementation=foreach",
    ]
    assert line.removeprefix("gpu_check: ") in (tmp_path / "gpu_check.md").read_text()


def skip_the_import_probe(monkeypatch) -> None:
    """What the probe would find, without its process (seconds of importing every package): torch alone, as the
    made-up steps below need nothing else. The probe itself is the dry run's and the torchao test's."""
    monkeypatch.setattr(runner, "probe_imports", lambda ctx: {"torch": torch.__version__})
    monkeypatch.setattr(runner, "probe_compile", lambda ctx: ("yes", "gpu_check: torch.compile works on cpu"))


def made_up_steps(hanging: bool) -> dict:
    """A fine step, a failing one, one that needs a missing package, a hanging one (with ``hanging``), a fine one."""
    steps = {
        "fine": plan.Step(fine_step, 1, 2),
        "broken": plan.Step(broken_step, 1, 2),
        "unequipped": plan.Step(fine_step, 1, 2, needs=("no_such_package_here",)),
        "hangs": plan.Step(hanging_step, 1, 2),
        "after": plan.Step(fine_step, 1, 2),
    }
    if not hanging:
        del steps["hangs"]
    return steps


def test_a_failing_hanging_or_unequipped_step_fails_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "STEPS", made_up_steps(hanging=True))
    # The steps that finish get time for a loaded machine to start Python and torch; the hanging one a short budget.
    monkeypatch.setattr(runner, "step_budget", lambda name, dry_run: 20 if name == "hangs" else 120)
    skip_the_import_probe(monkeypatch)
    started = time.monotonic()
    report = runner.run(tmp_path, dry_run=True, together=False)  # a process per step, as on a GPU
    steps = report["steps"]
    assert steps["fine"]["status"] == "ok" and steps["fine"]["rows"] == [{"checked": "yes"}]
    assert steps["broken"]["status"] == "failed" and "broken on purpose" in steps["broken"]["error"]
    assert steps["broken"]["rows"] == [{"measured": "before breaking"}]  # what it measured first is kept
    assert steps["unequipped"] == {
        "status": "skipped",
        "error": "skipped: needs no_such_package_here (not importable)",
        "seconds": 0.0,
    }
    assert steps["hangs"]["status"] == "failed" and "stopped at its budget of 20 s" in steps["hangs"]["error"]
    seen = json.loads(steps["hangs"]["rows"][0]["report while running"])
    assert seen == {
        "fine": "ok",
        "broken": "failed",
        "unequipped": "skipped",
        "hangs": "not run yet",
        "after": "not run yet",
    }
    assert not processes._alive(
        steps["hangs"]["rows"][0]["started"]
    )  # killed with the step, though in a session of its own
    assert steps["after"]["status"] == "ok"
    assert time.monotonic() - started < 5 * 60  # the hanging step was stopped at its budget
    assert "## broken: failed" in (tmp_path / "gpu_check.md").read_text()


def test_steps_run_together_keep_their_own_outcomes(tmp_path, monkeypatch):
    """A dry run's steps share one process: a step that fails still fails alone, with what it measured first, and
    the next one runs."""
    monkeypatch.setattr(runner, "STEPS", made_up_steps(hanging=False))
    skip_the_import_probe(monkeypatch)
    steps = runner.run(tmp_path, dry_run=True)["steps"]
    assert [steps[name]["status"] for name in steps] == ["ok", "failed", "skipped", "ok"]
    assert "broken on purpose" in steps["broken"]["error"]
    assert steps["broken"]["rows"] == [{"measured": "before breaking"}]
    assert steps["after"]["rows"] == [{"checked": "yes"}]
    assert (tmp_path / "logs" / "steps.log").is_file() and not (tmp_path / "logs" / "fine.log").exists()


def test_unknown_step_or_optimizer_is_a_user_error(capsys):
    with pytest.raises(UserError, match="unknown nope"):
        runner.names_of("nope", list(plan.STEPS), "only")
    assert gpu_check.main(["--out", "/nonexistent/x", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: unknown nope;") and err.count("\n") == 1, err  # one line, no traceback
    assert gpu_check.main(["--out", "/nonexistent/x", "--quick", "--only", "gpu_tests"]) == 2
    assert "--quick is the group 'quick'" in capsys.readouterr().err


def test_a_failing_or_hanging_component_check_fails_its_step(tmp_path, monkeypatch):
    stale = tmp_path / "hf-roundtrip" / "checkpoint"
    stale.mkdir(parents=True)
    commands = [
        ("passes", [sys.executable, "-c", "print('fine')"], ()),
        ("fails", [sys.executable, "-c", "print('about to fail'); raise SystemExit(1)"], ()),
        ("hangs", [sys.executable, "-c", "import time; time.sleep(60)"], ()),
        ("unequipped", [sys.executable, "-c", "print('never run')"], ("no_such_package_here",)),
    ]
    monkeypatch.setattr(plan, "component_commands", lambda out: commands)
    monkeypatch.setattr(context, "COMMAND_TIMEOUT_S", 5)
    ctx = context.Context(sizes=context.Sizes.for_run(dry_run=True), out=tmp_path, dry_run=False)
    result = plan.step_component_checks(ctx)
    assert not stale.parent.exists()  # a rerun with the same --out starts the export afresh
    assert len(runner.broken_rows(result.rows)) == 2
    results = {row["check"]: (row["result"], row.get("output")) for row in result.rows}
    assert results == {
        "passes": ("ok", "fine"),
        "fails": (context.FAILED, "about to fail"),
        "hangs": (context.FAILED, "(timed out after 5 s)"),
        "unequipped": ("skipped: needs no_such_package_here (not importable)", None),
    }


def test_without_torchao_its_steps_and_rows_are_skipped_and_the_others_run(tmp_path):
    """A machine without torchao: the first line says so, the low-bit optimizer's row and the step of low-bit
    optimizers are skipped with that reason, AdamW is still trained and estimated."""
    hidden = tmp_path / "hide" / "torchao"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('torchao is not installed on this machine')\n")
    out = tmp_path / "report"
    command = [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)]
    command += ["--only", "optimizers_1b,optimizers_1b_more", "--optimizers", "AdamW,AdamMini8bit,AdamMini4bit"]
    done = processes.run(command, env=launch_env(cpu=True, PYTHONPATH=str(tmp_path / "hide")), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith("gpu_check: imports present: torch ") and first.endswith("missing: torchao"), first
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    rows = {row["optimizer"]: row for row in steps["optimizers_1b"]["rows"]}
    assert rows["AdamMini8bit"] == {"optimizer": "AdamMini8bit", "fits": "skipped: needs torchao (not importable)"}
    assert rows["AdamW"]["fits"] == "yes" and rows["AdamW"]["estimated peak allocated GiB"] is not None
    assert steps["optimizers_1b"]["status"] == "ok"
    assert steps["optimizers_1b_more"]["status"] == "skipped"
    assert steps["optimizers_1b_more"]["error"] == "skipped: needs torchao (not importable)"


def test_sigterm_ends_the_check_with_its_processes_and_a_report(tmp_path, monkeypatch):
    """``timeout`` ends a device command's check with SIGTERM: the running step and what it started are killed, its
    saved rows and the finished steps' results are in the report, and the remaining steps are not run."""
    monkeypatch.setattr(
        runner,
        "STEPS",
        {
            "fine": plan.Step(fine_step, 1, 2),
            "hangs": plan.Step(hanging_step, 1, 2),
            "after": plan.Step(fine_step, 1, 2),
        },
    )
    skip_the_import_probe(monkeypatch)
    saved = context.result_path(tmp_path, "hangs")

    def terminate_once_the_step_hangs():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (saved.is_file() and "started" in saved.read_text()):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_once_the_step_hangs, daemon=True).start()
    report = runner.run(tmp_path, dry_run=True, together=False)
    assert signal.getsignal(signal.SIGTERM) is previous  # the check's handler is undone
    assert report["ended"] == "SIGTERM"
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["fine"]["status"] == "ok" and steps["after"] == {"status": "not run yet"}
    assert steps["hangs"]["status"] == "failed" and "ended (SIGTERM)" in steps["hangs"]["error"]
    assert not processes._alive(steps["hangs"]["rows"][0]["started"])
    assert (
        signal.getsignal(signal.SIGTERM) is not None and "## hangs: failed" in (tmp_path / "gpu_check.md").read_text()
    )
