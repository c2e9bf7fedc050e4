"""The lr sweep: runs every combination, resumes without rerunning finished runs, reports best-vs-best.

One end-to-end sweep of two real runs goes through scripts/compare_optimizers.sh and run_llama_train.sh on the debug
model; the rest use tests/sweep_fake_trainer.py as the launcher, which logs a made-up run in a second.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import (
    FAKE,
    LOSS,
    ROOT,
    attempts,
    fake_sweep,
    logged,
    one_error_line,
    snapshot,
    status_of,
)
from tests.helpers import sweep_env as env
from torchtitan.tools.compare_runs import main as compare_main
from torchtitan.tools.sweep import main


def metrics(run_dir: Path, *tags: str) -> list:
    """(step, values of ``tags``) of every line of a run's metrics.jsonl files, as logged (NaN compares equal)."""
    rows = []
    for path in sorted(run_dir.rglob("metrics.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if tags[0] in row:
                rows.append((row["step"], *(repr(row.get(tag)) for tag in tags)))
    return rows


def check_png(path: Path) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] >= 1000
        assert np.asarray(image.convert("L"), dtype=np.float32).std() > 5.0


def markdown_row(md: str, optimizer: str, table: int) -> str:
    """The row of ``optimizer`` in the report's first (best lr) or second (grid) table."""
    tables = md.split("\n\n")
    return next(line for line in tables[table + 1].splitlines() if line.startswith(f"| {optimizer} |"))


# ----------------------------------------------------------------------------------------------------------------
# End to end: the real trainer


def test_tiny_sweep_end_to_end_ranks_and_shows_divergence(tmp_path, capsys):
    """The one sweep of real train.py runs, as users start it (compare_optimizers.sh, run_llama_train.sh): what the
    trainer logs is what the report ranks and draws, a diverging lr is a diverged run and not a crash, two runs at
    once log what one alone logs, and compare_runs reads the same numbers. Every other sweep test runs the fake
    trainer."""
    # Two real runs at once, the fewest that show both outcomes: a finished lr and a diverging one; then the
    # finished one again alone, which logs the same numbers. What the sweep does with many runs (seeds, retries,
    # resuming, extending, descents) is the fake trainer's part below and in test_sweep_search.py.
    dump = tmp_path / "sweep"
    command = [
        str(ROOT / "scripts" / "compare_optimizers.sh"),
        "--training.seq_len",
        "32",
        "--training.batch_size",
        "2",
        "--training.steps",
        "4",
        "--training.warmup_steps",
        "1",
        "--metrics.log_freq",
        "1",
        "--training.max_norm",
        "0",
    ]
    sweep_env = env(OPTIMIZERS="adam_mini", LRS="1e-3 1e6", NGPU="1", LAST_K="2", DUMP_FOLDER=str(dump), PARALLEL="2")
    proc = subprocess.run(command, cwd=tmp_path, env=sweep_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = {**sweep_env, "PARALLEL": "1", "LRS": "1e-3", "DUMP_FOLDER": str(tmp_path / "alone")}
    proc = subprocess.run(command, cwd=tmp_path, env=alone, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = dump / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["AdamMini_lr1e-3_seed0", "AdamMini_lr1e6_seed0"]
    report = json.loads((dump / "sweep.json").read_text())
    md = (dump / "sweep.md").read_text()
    check_png(dump / "sweep.png")
    good, bad = report["runs"]
    assert report["ranked_by"] == "mean of the last 2 logged training losses" and "last 2" in md
    # The table against the TensorBoard logs.
    losses = logged(runs / good["name"], LOSS)
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    expected = (losses[-1][1] + losses[-2][1]) / 2
    # TensorBoard holds float32; the report reads metrics.jsonl, the logged values themselves.
    assert good["outcome"] == "finished" and good["final_loss"] == pytest.approx(expected, rel=1e-6)
    tps = [v for _, v in logged(runs / good["name"], "throughput/tps")]
    assert good["mean_tps"] == pytest.approx(sum(tps[2:]) / len(tps[2:]), rel=1e-6)  # after the compile warm-up
    state = logged(runs / good["name"], "optimizer/state_bytes")[0][1]
    assert good["optimizer_state_bytes"] == pytest.approx(state, rel=1e-6) and state > 0
    assert report["best"]["AdamMini"]["lr"] == 1e-3
    assert f"**{good['final_loss']:.4f} (1 seed)**" in markdown_row(md, "AdamMini", 1)
    edge = "(at the grid's edge: 1e-3 is the smallest lr tried)"
    choice = "lr 1e-3: the lowest cell (fewer than three finished values near the lowest cell)"  # 1e6 diverged
    assert f"| AdamMini | lr 1e-3 {edge} | {choice} | {good['final_loss']:.4f} (1 seed) |" in markdown_row(
        md, "AdamMini", 0
    )
    # The main picture, the tuning, sensitivity to the lr (1e6 marked diverged) and the overview, embedded.
    assert (dump / "study.html").read_text().count("data:image/png;base64,") == 4
    # lr 1e6 without clipping: the logged loss or gradient norm becomes NaN (a saturated model can keep a finite
    # loss while the guard skips its NaN-gradient steps); the run is diverged, not a crash of the tool.
    first_nan = min(
        step for tag in (LOSS, "grad_norm") for step, value in logged(runs / bad["name"], tag) if math.isnan(value)
    )
    assert bad["outcome"] == "diverged" and bad["diverged_at_step"] == first_nan and bad["final_loss"] is None
    assert f"diverged (step {first_nan})" in markdown_row(md, "AdamMini", 1)

    # The two ran at once (each its own process) and logged what the same run alone logs, step for step.
    first, second = (status_of(runs / r["name"]) for r in (good, bad))
    assert first["started"] < second["ended"] and second["started"] < first["ended"]
    assert metrics(runs / good["name"], LOSS, "grad_norm") == metrics(
        tmp_path / "alone" / "runs" / good["name"], LOSS, "grad_norm"
    )
    # Each run keeps the resolved config it trained with, which the page links.
    page = (dump / "study.html").read_text()
    for run in (good, bad):
        assert run["config"] and (dump / run["config"]).is_file() and f'href="{run["config"]}"' in page

    # compare_runs reads the same runs into the same numbers (one summary for both tools).
    for run in (good, bad):
        assert compare_main([str(runs / run["name"]), "--out", str(tmp_path / "c.png"), "--last-k", "2", "--json"]) == 0
        (compared,) = json.loads(capsys.readouterr().out)
        assert {k: compared[k] for k in compared if k in run and k != "name"} == {
            k: run[k] for k in compared if k in run and k != "name"
        }
        assert {"final_loss", "diverged_at_step", "mean_tps", "optimizer_state_bytes"} <= set(compared) & set(run)


# ----------------------------------------------------------------------------------------------------------------
# The sweep's logic, with the fake trainer


def test_the_fake_trainer_starts_without_torch():
    # What keeps the sweep's tests fast: each fake run is a fresh process, and torch alone takes seconds to import.
    code = "import sys, tests.sweep_fake_trainer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_seeds_divergence_by_exit_code_and_failures_retried(tmp_path, capsys):
    dump = tmp_path / "sweep"
    grid = ["--optimizers", "AdamW,adam_mini", "--lrs", "1e-4 1e-3 1e-2", "--seeds", "0 1"]
    outcomes = {"AdamW_lr1e-2_seed1": "exit3", "AdamMini_lr1e-4_seed0": "exit1", "AdamMini_lr1e-2_seed0": "nan"}
    assert fake_sweep(dump, *grid, outcomes=outcomes) == 1  # a failed run makes the sweep fail, after the others
    captured = capsys.readouterr()
    assert "error: 1 of 12 runs failed" in captured.err
    assert "AdamMini_lr1e-4_seed0: failed, exit 1" in captured.out and "fake trainer crashed" in captured.out
    runs = dump / "runs"
    assert len(list(runs.glob("*/sweep_status.json"))) == 12

    report = json.loads((dump / "sweep.json").read_text())
    cells = {(c["optimizer"], c["lr"]): c for c in report["grid"]}
    assert list(report["best"]) == ["AdamW", "AdamMini"]  # the sweep's order, names as train.py spells them
    assert cells["AdamW", 1e-2]["outcome"] == "diverged" and cells["AdamW", 1e-2]["runs_diverged"] == 1
    assert cells["AdamMini", 1e-2]["outcome"] == "diverged"
    assert cells["AdamMini", 1e-4]["outcome"] == "failed"
    # Mean and spread over seeds, from the logs: the fake's loss at its last 3 steps, plus 0.01 per seed.
    per_seed = [np.mean([logged(runs / f"AdamW_lr1e-3_seed{s}", LOSS)[i][1] for i in (-3, -2, -1)]) for s in (0, 1)]
    assert cells["AdamW", 1e-3]["loss_mean"] == pytest.approx(np.mean(per_seed), rel=1e-9)
    assert cells["AdamW", 1e-3]["loss_std"] == pytest.approx(np.std(per_seed, ddof=1), rel=1e-6)
    assert report["best"]["AdamW"]["lr"] == 1e-3 and report["best"]["AdamMini"]["lr"] == 1e-3
    md = (dump / "sweep.md").read_text()
    assert "diverged 1/2 seeds (step 3)" not in markdown_row(md, "AdamW", 1)  # exit 3 logged no non-finite value
    assert "diverged 1/2 seeds" in markdown_row(md, "AdamW", 1)
    assert "diverged 1/2 seeds (step 3)" in markdown_row(md, "AdamMini", 1)
    assert "failed 1/2 seeds (exit 1)" in markdown_row(md, "AdamMini", 1)
    assert "± " in markdown_row(md, "AdamW", 0) and "(2 seeds)" in markdown_row(md, "AdamW", 0)
    check_png(dump / "sweep.png")
    exit3 = json.loads((runs / "AdamW_lr1e-2_seed1" / "sweep_status.json").read_text())
    assert exit3["outcome"] == "diverged" and "non-finite" in exit3["message"]

    # Again: only the failed run trains again; diverged and finished ones are not retried, nor touched.
    before = {run.name: snapshot(run) for run in runs.iterdir()}
    assert fake_sweep(dump, *grid) == 0
    assert capsys.readouterr().out.count("earlier, skipped") == 11
    retried = runs / "AdamMini_lr1e-4_seed0"
    for run in runs.iterdir():
        assert attempts(run) == (2 if run == retried else 1), run.name
        assert run == retried or snapshot(run) == before[run.name], run.name
    report = json.loads((dump / "sweep.json").read_text())
    assert {(c["optimizer"], c["lr"]): c["outcome"] for c in report["grid"]}[("AdamMini", 1e-4)] == "finished"
    # The retry logged into a folder of its own; the summary reads both attempts, the later one winning.
    assert len({p.parent for p in retried.rglob("events.out.tfevents*")}) == 2
    losses = logged(retried, LOSS)
    summary = next(r for r in report["runs"] if r["name"] == retried.name)
    assert summary["last_step"] == 6 and summary["final_loss"] == pytest.approx(
        np.mean([v for _, v in losses[-3:]]), rel=1e-9
    )

    # Extending the sweep with another lr trains only the new runs.
    assert fake_sweep(dump, *grid[:2], "--lrs", "1e-4 1e-3 1e-2 3e-3", *grid[4:]) == 0
    assert sorted(p.name for p in runs.iterdir() if attempts(p) == 1 and "3e-3" in p.name) == [
        "AdamMini_lr3e-3_seed0",
        "AdamMini_lr3e-3_seed1",
        "AdamW_lr3e-3_seed0",
        "AdamW_lr3e-3_seed1",
    ]

    # --report-only rewrites the report from the folder alone.
    (dump / "sweep.json").unlink()
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "3"]) == 0
    assert len(json.loads((dump / "sweep.json").read_text())["runs"]) == 16


def test_validation_loss_ranks_when_every_run_logs_it(tmp_path, capsys):
    # The fake's training loss is best at lr 1e-3, its validation loss at 1e-2.
    assert fake_sweep(tmp_path / "val", "--optimizers", "AdamW", "--lrs", "1e-3,1e-2", validation=True) == 0
    report = json.loads((tmp_path / "val" / "sweep.json").read_text())
    assert report["by_validation"] and report["ranked_by"] == "last validation/loss"
    assert report["best"]["AdamW"]["lr"] == 1e-2
    run = tmp_path / "val" / "runs" / "AdamW_lr1e-2_seed0"
    assert report["best"]["AdamW"]["loss_mean"] == pytest.approx(logged(run, "validation/loss")[-1][1], rel=1e-12)
    assert "Ranked by the last validation/loss" in (tmp_path / "val" / "sweep.md").read_text()

    assert fake_sweep(tmp_path / "train", "--optimizers", "AdamW", "--lrs", "1e-3,1e-2") == 0
    report = json.loads((tmp_path / "train" / "sweep.json").read_text())
    assert not report["by_validation"] and report["best"]["AdamW"]["lr"] == 1e-3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lrs", "1e-3 fast"], "learning rate 'fast' is not a number"),
        (["--lrs", "0"], "must be a positive number"),
        (["--seeds", "-1"], "must be non-negative integers"),
        (["--optimizers", "AdamW Sgd"], "unknown optimizer.name 'Sgd'"),
        (["--optimizers", "AdamW adamw"], "lists a run twice (AdamW_lr1e-3_seed0)"),
        (["--", "--optimizer.lr", "1"], "--optimizer.lr is set by the sweep"),
        (["--", "--job.dump_folder=x"], "--job.dump_folder is set by the sweep"),
        (["--", "--training.stepz", "3"], "unknown config key 'training.stepz'"),
        (["--", "--optimizer.value_blocks", "per_tensor"], "does not apply to AdamW"),
    ],
)
def test_bad_input_is_one_line_and_runs_nothing(tmp_path, capsys, args, message):
    dump = tmp_path / "sweep"
    tail = args[args.index("--") :] if "--" in args else []
    head = args[: len(args) - len(tail)]
    base = ["--optimizers", "AdamW,AdamMini", "--lrs", "1e-3"]
    assert fake_sweep(dump, *base, *head, *tail) == 2
    assert message in one_error_line(capsys)
    assert not dump.exists()


def test_other_options_a_second_sweep_and_a_user_error_in_a_run_stop_the_sweep(tmp_path, capsys):
    dump = tmp_path / "sweep"
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", "--", "--training.steps", "6") == 0
    capsys.readouterr()
    before = snapshot(dump)
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", "--", "--training.steps", "8") == 2
    assert "holds a sweep run with other settings (train_args differ" in one_error_line(capsys)
    assert snapshot(dump) == before

    # One sweep at a time in a folder.
    with open(dump / "sweep.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", "--", "--training.steps", "6") == 2
        assert "another sweep is running in" in one_error_line(capsys)

    # A run that exits 2 (a mistake in the options) stops the sweep there: the next runs would fail the same way.
    assert (
        fake_sweep(
            tmp_path / "b", "--optimizers", "AdamW", "--lrs", "1e-3 1e-2", outcomes={"AdamW_lr1e-3_seed0": "exit2"}
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "error: AdamW_lr1e-3_seed0 stopped on a mistake in its options: error: training.steps" in captured.err
    assert not (tmp_path / "b" / "runs" / "AdamW_lr1e-2_seed0").exists()


def test_interrupted_sweep_ends_its_runs_and_leaves_them_unfinished(tmp_path):
    # Two runs at once, both still training when the sweep is stopped: neither outlives it, neither has a status.
    dump = tmp_path / "sweep"
    names = ["AdamW_lr1e-3_seed0", "AdamW_lr1e-2_seed0"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtitan.tools.sweep",
            "--dump-folder",
            str(dump),
            "--launcher",
            FAKE,
            "--nproc",
            "1",
            "--parallel",
            "2",
            "--optimizers",
            "AdamW",
            "--lrs",
            "1e-3,1e-2",
        ],
        cwd=ROOT,
        env=env(FAKE_OUTCOMES=json.dumps({name: "hang" for name in names})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid_files = [dump / "runs" / name / "fake.pid" for name in names]
    trainers = []
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pid_files) and proc.poll() is None:
            assert time.monotonic() < deadline, "the fake runs never started"
            time.sleep(0.1)
        trainers = [int(p.read_text()) for p in pid_files]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in (proc.pid, *trainers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert proc.returncode == 130
    assert err.strip() == "error: sweep interrupted; run the same command again to resume it"
    for trainer, pid_file in zip(trainers, pid_files):
        assert not Path(f"/proc/{trainer}").exists() or "zombie" in Path(f"/proc/{trainer}/status").read_text()
        assert not (pid_file.parent / "sweep_status.json").exists()


def test_the_plan_names_muon_family_runs_as_train_py_logs_them():
    from torchtitan.study.plan import plan

    specs = plan(["muon", "nor_muon"], [1e-2], [0])
    assert [(s.optimizer, s.name) for s in specs] == [
        ("Muon", "Muon_lr1e-2_seed0"),
        ("NorMuon", "NorMuon_lr1e-2_seed0"),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Token budgets


def test_budgets_are_runs_of_their_own_length_and_schedule_and_the_report_fits_them(tmp_path, capsys):
    dump = tmp_path / "budgets"
    # debug_model.toml: batch 4 x seq_len 256 x 1 data-parallel rank x 1 micro-batch = 1024 tokens per step, and a
    # warmup of 4 of its 40 steps: each budget warms up a tenth of its own steps.
    grid = ["--optimizers", "AdamW", "--lrs", "1e-3"]
    assert fake_sweep(dump, *grid, "--budgets", "4096,6e3,8192") == 0
    runs = dump / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [
        "AdamW_lr1e-3_seed0_tokens4096",
        "AdamW_lr1e-3_seed0_tokens6e3",
        "AdamW_lr1e-3_seed0_tokens8192",
    ]
    for label, tokens, steps, warmup in (("4096", 4096, 4, 0), ("6e3", 6000, 5, 0), ("8192", 8192, 8, 1)):
        run = runs / f"AdamW_lr1e-3_seed0_tokens{label}"
        status = status_of(run)
        assert (status["budget"], status["steps"], status["warmup_steps"]) == (tokens, steps, warmup)
        assert f"--training.steps {steps} --training.warmup_steps {warmup}" in status["command"]
        assert logged(run, LOSS)[-1][0] == steps  # trained its own length, not a cut of a longer run
    report = json.loads((dump / "sweep.json").read_text())
    assert sorted(r["name"] for r in report["runs"]) == sorted(p.name for p in runs.iterdir())
    assert report["budgets"] == [4096, 6000, 8192]
    fit = report["budget_fit"]
    best = [b["best"]["AdamW"]["loss_mean"] for b in report["best_by_budget"]]
    assert [p["loss"] for p in fit["points"]] == best and best == sorted(best, reverse=True)
    assert fit["fit"] is not None and fit["fit"]["beta"] > 0

    # A fourth budget extends the study: only its run trains.
    capsys.readouterr()
    assert fake_sweep(dump, *grid, "--budgets", "4096,6e3,8192,1.2e4") == 0
    assert capsys.readouterr().out.count("earlier, skipped") == 3
    assert [attempts(p) for p in sorted(runs.iterdir())] == [1, 1, 1, 1]
    assert status_of(runs / "AdamW_lr1e-3_seed0_tokens1.2e4")["steps"] == 11
    assert len(json.loads((dump / "sweep.json").read_text())["budget_fit"]["points"]) == 4


def test_budgets_in_tokens_per_parameter_count_the_non_embedding_parameters(tmp_path):
    from torchtitan.config.job_config import JobConfig
    from torchtitan.config.preflight import model_args_for
    from torchtitan.models.llama import non_embedding_params

    dump = tmp_path / "x"
    batch = ["--training.batch_size", "8192", "--training.seq_len", "256"]  # 2^21 tokens per step
    assert (
        fake_sweep(
            dump,
            "--optimizers",
            "AdamW",
            "--lrs",
            "1e-3",
            "--budgets",
            "0.5x,1x",
            "--warmup-fraction",
            "0.25",
            "--",
            *batch,
        )
        == 0
    )
    config = JobConfig.parse_args(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *batch])
    params = non_embedding_params(model_args_for(config, vocab_size=1))
    for label, multiple in (("0.5x", 0.5), ("1x", 1.0)):
        status = status_of(dump / "runs" / f"AdamW_lr1e-3_seed0_tokens{label}")
        steps = round(multiple * 20 * params) // 2**21
        assert (status["budget"], status["steps"]) == (round(multiple * 20 * params), steps)
        assert status["warmup_steps"] == round(steps / 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "2e8,fast"], "budget 'fast' is neither a token count nor a multiple"),
        (["--budgets", "0x"], "budget '0x' is neither"),
        (["--budgets", "1000"], "budget 1e3 (1,000 tokens) is less than one step of 1,024 tokens"),
        (["--budgets", "4096,4.096e3"], "lists the budget of 4096 tokens twice"),
        (["--budgets", "4096", "--warmup-fraction", "1"], "--warmup-fraction must be at least 0 and below 1"),
        (["--warmup-fraction", "0.1"], "--warmup-fraction applies to --budgets"),
        (["--budgets", "4096", "--", "--training.steps", "3"], "--training.steps is set by the sweep for each budget"),
        (["--budgets", "4096", "--", "--training.warmup_steps=3"], "use --warmup-fraction"),
    ],
)
def test_bad_budgets_are_one_line_and_run_nothing(tmp_path, capsys, args, message):
    dump = tmp_path / "sweep"
    tail = args[args.index("--") :] if "--" in args else []
    head = args[: len(args) - len(tail)]
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", *head, *tail) == 2
    assert message in one_error_line(capsys)
    assert not (dump / "runs").exists()


# ----------------------------------------------------------------------------------------------------------------
# Any option as an axis


def test_any_option_is_an_axis_globally_or_per_optimizer_and_the_grid_extends(tmp_path, capsys):
    dump = tmp_path / "axes"
    # The fake's loss is lowest at weight decay 0.1 for AdamW and 0.3 for Muon; beta2 changes nothing in it.
    grid = ["--optimizers", "AdamW,Muon", "--lrs", "1e-3", "--axis", "Muon:optimizer.beta2=0.95,0.99"]
    assert fake_sweep(dump, *grid, "--axis", "optimizer.weight_decay=0.0,0.1,0.3") == 0
    runs = dump / "runs"
    names = sorted(p.name for p in runs.iterdir())
    assert names == sorted(
        [f"AdamW_lr1e-3_seed0_optimizer.weight_decay{wd}" for wd in ("0.0", "0.1", "0.3")]
        + [
            f"Muon_lr1e-3_seed0_optimizer.beta2{b2}_optimizer.weight_decay{wd}"
            for b2 in ("0.95", "0.99")
            for wd in ("0.0", "0.1", "0.3")
        ]
    )
    status = status_of(runs / "Muon_lr1e-3_seed0_optimizer.beta20.99_optimizer.weight_decay0.3")
    assert status["options"] == {"optimizer.beta2": 0.99, "optimizer.weight_decay": 0.3}
    assert "--optimizer.beta2 0.99 --optimizer.weight_decay 0.3" in status["command"]
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["AdamW"]["settings"] == {"lr": 1e-3, "optimizer.weight_decay": 0.1}
    assert report["best"]["Muon"]["settings"]["optimizer.weight_decay"] == 0.3
    assert len(report["grid"]) == 9  # one cell per value of every axis
    assert sorted(r["name"] for r in report["runs"]) == names

    # Without budgets a run's length and warmup are axes like any other option.
    assert fake_sweep(tmp_path / "steps", "--optimizers", "AdamW", "--lrs", "1e-3", "--axis", "training.steps=4,5") == 0
    assert [
        logged(tmp_path / "steps" / "runs" / f"AdamW_lr1e-3_seed0_training.steps{n}", LOSS)[-1][0] for n in (4, 5)
    ] == [4, 5]

    # A new value extends the grid: only its runs train.
    capsys.readouterr()
    assert fake_sweep(dump, *grid, "--axis", "optimizer.weight_decay=0.0,0.1,0.3,0.2") == 0
    assert capsys.readouterr().out.count("earlier, skipped") == 9
    new = [p.name for p in runs.iterdir() if "weight_decay0.2" in p.name]
    assert len(new) == 3 and all(attempts(p) == 1 for p in runs.iterdir())


@pytest.mark.parametrize(
    "axis, message",
    [
        (["--axis", "optimizer.weight_decay"], "is not an axis; give one like"),
        (["--axis", "optimizer.lr=1e-3,1e-2"], "--axis optimizer.lr is swept by the sweep's own --lrs"),
        (["--axis", "optimizer.weight_decay=0.1,0.10"], "lists a value twice"),
        (["--axis", "Muon:optimizer.beta2=0.9"], "Muon is not in --optimizers"),
        (["--axis", "optimizer.eps=1e-8", "--axis", "AdamW:optimizer.eps=1e-6"], "is given twice for AdamW's runs"),
        (["--axis", "optimizer.eps=1e-8", "--", "--optimizer.eps", "1e-6"], "also set among the train.py options"),
        (["--axis", "optimizer.wd=0.1"], "unknown config key 'optimizer.wd'"),
        (["--budgets", "4096", "--axis", "training.warmup_steps=1,2"], "swept by the sweep's own --warmup-fraction"),
        (["--vary-data-seed", "--axis", "training.data_seed=1,2"], "is set by --vary-data-seed for each run"),
    ],
)
def test_bad_axes_are_one_line_and_run_nothing(tmp_path, capsys, axis, message):
    dump = tmp_path / "sweep"
    tail = axis[axis.index("--") :] if "--" in axis else []
    head = axis[: len(axis) - len(tail)]
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", *head, *tail) == 2
    assert message in one_error_line(capsys)
    assert not (dump / "runs").exists()


def test_the_comparison_script_passes_budgets_and_warmup_fraction(tmp_path):
    # Checked before any run starts: a budget below one step (debug_model.toml: 1024 tokens), then a bad fraction.
    script = [str(ROOT / "scripts" / "compare_optimizers.sh")]
    for extra, message in (
        ({"BUDGETS": "1000 4096"}, "error: budget 1e3 (1,000 tokens) is less than one step of 1,024 tokens"),
        ({"BUDGETS": "4096", "WARMUP_FRACTION": "1.5"}, "error: --warmup-fraction must be at least 0 and below 1"),
    ):
        sweep_env = env(OPTIMIZERS="AdamW", LRS="1e-3", NGPU="1", DUMP_FOLDER=str(tmp_path / "sweep"), **extra)
        proc = subprocess.run(script, cwd=tmp_path, env=sweep_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stderr.strip().startswith(message), proc.stderr
        assert not (tmp_path / "sweep" / "runs").exists()


def test_adam_minis_partition_rules_are_axes_of_a_study(tmp_path):
    dump = tmp_path / "partition"
    axes = [
        "--axis",
        "AdamMini:optimizer.embedding_blocks=per_row,per_element",
        "--axis",
        "AdamMini:optimizer.mlp_blocks=per_row,per_tensor",
    ]
    assert fake_sweep(dump, "--optimizers", "AdamW,AdamMini", "--lrs", "1e-3", *axes) == 0
    names = sorted(p.name for p in (dump / "runs").iterdir())
    assert names == sorted(
        ["AdamW_lr1e-3_seed0"]
        + [
            f"AdamMini_lr1e-3_seed0_optimizer.embedding_blocks{e}_optimizer.mlp_blocks{m}"
            for e in ("per_element", "per_row")
            for m in ("per_row", "per_tensor")
        ]
    )
    status = status_of(
        dump / "runs" / "AdamMini_lr1e-3_seed0_optimizer.embedding_blocksper_element_optimizer.mlp_blocksper_tensor"
    )
    assert "--optimizer.embedding_blocks per_element --optimizer.mlp_blocks per_tensor" in status["command"]


def test_ademamix_is_swept_with_its_own_options_as_axes(tmp_path):
    dump = tmp_path / "ademamix"
    axis = ["--axis", "AdEMAMix:optimizer.ademamix_alpha=5,8"]
    assert fake_sweep(dump, "--optimizers", "AdamW,ademamix", "--lrs", "1e-3", *axis) == 0
    names = sorted(p.name for p in (dump / "runs").iterdir())
    assert names == [
        "AdEMAMix_lr1e-3_seed0_optimizer.ademamix_alpha5",
        "AdEMAMix_lr1e-3_seed0_optimizer.ademamix_alpha8",
        "AdamW_lr1e-3_seed0",
    ]
    report = json.loads((dump / "sweep.json").read_text())
    assert set(report["best"]) == {"AdamW", "AdEMAMix"}


def test_soap_and_its_refresh_interval_are_a_study_axis(tmp_path):
    dump = tmp_path / "soap"
    axis = ["--axis", "SOAP:optimizer.precondition_frequency=10,50"]
    assert fake_sweep(dump, "--optimizers", "AdamW,soap", "--lrs", "1e-3", *axis) == 0
    names = sorted(p.name for p in (dump / "runs").iterdir())
    assert names == [
        "AdamW_lr1e-3_seed0",
        "SOAP_lr1e-3_seed0_optimizer.precondition_frequency10",
        "SOAP_lr1e-3_seed0_optimizer.precondition_frequency50",
    ]
    status = status_of(dump / "runs" / "SOAP_lr1e-3_seed0_optimizer.precondition_frequency50")
    assert "--optimizer.name SOAP" in status["command"]
    assert "--optimizer.precondition_frequency 50" in status["command"]


def test_a_study_resolves_each_job_once(tmp_path, monkeypatch):
    # A study with a budget (tokens per step, the job's warmup), confirmation seeds (their validation windows), W&B's
    # group and preflight of every cell reads each distinct job (config file and options) once: none parsed again.
    from torchtitan.config.job_config import JobConfig
    from torchtitan.study.plan import _resolve_job

    _resolve_job.cache_clear()
    parsed = []
    parse = JobConfig.parse_args.__func__

    def counting(cls, argv):
        parsed.append(tuple(argv))
        return parse(cls, argv)

    monkeypatch.setattr(JobConfig, "parse_args", classmethod(counting))
    assert (
        fake_sweep(tmp_path, "--optimizers", "AdamW", "--lrs", "1e-3", "--budgets", "2e4", "--confirm-seeds", "1") == 0
    )
    assert parsed and len(parsed) == len(set(parsed)), [a for a in parsed if parsed.count(a) > 1][:2]
