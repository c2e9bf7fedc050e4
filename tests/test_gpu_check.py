"""scripts/gpu_check.sh: its dry run (the GPU plan on the CPU with tiny shapes) runs every step, and the plan
follows the optimizer registry and keeps going when a step fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.distributed import launch_env
from tests.helpers import ROOT
from torchtitan.errors import UserError
from torchtitan.models.llama import llama3_configs
from torchtitan.optim.builder import OPTIMIZERS
from torchtitan.tools import gpu_check


def test_dry_run_runs_every_step_and_writes_the_report(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=launch_env(cpu=True),
        timeout=600,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {name: step.get("traceback") for name, step in report["steps"].items() if step["status"] != "ok"}
    assert failed == {} and done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(report["steps"]) == list(gpu_check.STEPS)
    trained = [row["optimizer"] for row in report["steps"]["optimizers_1b"]["rows"]]
    assert trained == gpu_check.optimizer_specs()
    assert all(
        row["fits"] == "yes" and row["estimated peak allocated GiB"] is not None
        for row in report["steps"]["optimizers_1b"]["rows"]
    )
    assert [row["optimizer"] for row in report["steps"]["llama3_8b"]["rows"]] == list(OPTIMIZERS)
    assert report["steps"]["async_checkpoint"]["rows"][1]["resumed from step 4"] is True
    saved = report["steps"]["checkpoint_memory"]["text"]
    assert "AdamMini4bit" in gpu_check.low_bit_names() and "--async-save" in saved
    for name in ["AdamW", *gpu_check.low_bit_names()]:
        assert saved.count(f"\n{name} ") == 2, saved  # a table row in the synchronous and the asynchronous run
    assert "fused AdamW" in report["steps"]["bench_optimizers"]["text"]
    listed = [row["result"] for row in report["steps"]["component_checks"]["rows"]]
    assert listed == ["listed (dry run)"] * len(gpu_check.component_commands(out))
    markdown = (out / "gpu_check.md").read_text()
    for name in gpu_check.STEPS:
        assert f"## {name}: ok" in markdown


def test_plan_follows_the_registry():
    specs = gpu_check.optimizer_specs()
    assert [s for s in specs if ":" not in s] == list(OPTIMIZERS)  # a new optimizer appears without edits here
    for variant in ("AdamW:implementation=fused", "AdamMini:implementation=foreach", "AdamMini:state_dtype=bfloat16"):
        assert variant in specs
    assert gpu_check.optimizer_specs(["AdamMini4bit"]) == ["AdamMini4bit"]
    assert "tests/test_estimation_cuda.py" in gpu_check.gpu_test_files()
    # The component checks name scripts that exist (the list cannot outlive a renamed benchmark).
    scripts = [command[1] for _, command in gpu_check.component_commands(ROOT) if command[1].endswith(".py")]
    assert "benchmarks/bench_loss.py" in scripts and "train.py" in scripts
    assert all((ROOT / script).is_file() for script in scripts), scripts


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("broken on purpose")

    def fine(ctx):
        return gpu_check.StepResult(rows=[{"checked": "yes"}])

    monkeypatch.setattr(gpu_check, "STEPS", {"broken": broken, "fine": fine})
    report = gpu_check.run(tmp_path, dry_run=True)
    assert not torch._dynamo.config.disable and "tiny" not in llama3_configs  # the dry run's settings are undone
    assert report["steps"]["broken"]["status"] == "failed" and "broken on purpose" in report["steps"]["broken"]["error"]
    assert report["steps"]["fine"]["status"] == "ok" and report["steps"]["fine"]["rows"] == [{"checked": "yes"}]
    assert "## broken: failed" in (tmp_path / "gpu_check.md").read_text()


def test_unknown_step_or_optimizer_is_a_user_error(capsys):
    with pytest.raises(UserError, match="unknown nope"):
        gpu_check._names("nope", list(gpu_check.STEPS), "only")
    assert gpu_check.main(["--out", "/nonexistent/x", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: unknown nope;") and err.count("\n") == 1, err  # one line, no traceback


def test_a_failing_or_hanging_component_check_fails_its_step(tmp_path, monkeypatch):
    stale = tmp_path / "hf-roundtrip" / "checkpoint"
    stale.mkdir(parents=True)
    commands = [
        ("passes", [sys.executable, "-c", "print('fine')"]),
        ("fails", [sys.executable, "-c", "print('about to fail'); raise SystemExit(1)"]),
        ("hangs", [sys.executable, "-c", "import time; time.sleep(60)"]),
    ]
    monkeypatch.setattr(gpu_check, "component_commands", lambda out: commands)
    monkeypatch.setattr(gpu_check, "COMMAND_TIMEOUT_S", 5)
    ctx = gpu_check.Context(sizes=gpu_check.Sizes.for_run(dry_run=True), out=tmp_path, dry_run=False)
    outcome = gpu_check.run_step("component_checks", ctx)
    assert not stale.parent.exists()  # a rerun with the same --out starts the export afresh
    assert outcome["status"] == "failed" and outcome["error"] == "2 of 3 runs failed (see the table)"
    results = {row["check"]: (row["result"], row["output"]) for row in outcome["rows"]}
    assert results == {
        "passes": ("ok", "fine"),
        "fails": (gpu_check.FAILED, "about to fail"),
        "hangs": (gpu_check.FAILED, "(timed out after 5 s)"),
    }
