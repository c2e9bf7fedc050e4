"""compare_runs: reads the TensorBoard layout train.py writes, plots the runs and tabulates their numbers."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from tests import processes
from torchtitan.tools.compare_runs import main

REPO = Path(__file__).resolve().parents[2]


def _f32(x: float) -> float:
    # Classic TensorBoard scalars are stored as float32.
    return float(np.float32(x))


def _write_run(
    folder: Path, steps: list[int], seed: int, *, memory_tag: str, tokens_per_step, state_bytes, state_new_style: bool
) -> dict:
    """Write a short fake run with the trainer's tags; return what a reader should compute from it."""
    rng = random.Random(seed)
    losses, tps, memory = [], [], []
    with SummaryWriter(log_dir=str(folder)) as w:
        for step in steps:
            loss = 10.0 * math.exp(-0.05 * step) + rng.uniform(0.0, 0.3)
            losses.append(_f32(loss))
            w.add_scalar("loss_metrics/global_avg_loss", loss, step)
            w.add_scalar("loss_metrics/global_max_loss", loss + 0.5, step)
            w.add_scalar("grad_norm", rng.uniform(0.5, 2.0), step)
            w.add_scalar("lr", 1e-3, step)
            tps.append(_f32(rng.uniform(1000.0, 2000.0)))
            w.add_scalar("throughput/tps", tps[-1], step)
            memory.append(_f32(rng.uniform(1.0, 3.0)))
            w.add_scalar(memory_tag, memory[-1], step)
            if tokens_per_step is not None:
                w.add_scalar("throughput/tokens_seen", step * tokens_per_step, step)
            if step == steps[0]:
                w.add_scalar(
                    "optimizer/state_bytes",
                    state_bytes,
                    step,
                    new_style=state_new_style,
                    double_precision=state_new_style,
                )
    return {
        "losses": losses,
        "tps": tps,
        "memory": memory,
        "last_step": steps[-1],
        "state_bytes": state_bytes,
        "tokens_seen": None if tokens_per_step is None else steps[-1] * tokens_per_step,
    }


@pytest.fixture
def runs(tmp_path):
    tb = tmp_path / "dump" / "tb"
    adamw = tb / "20250101-000000_AdamW"
    adam_mini = tb / "20250101-010000_AdamMini"
    expected = {
        # Every step logged, GPU-style peak memory, tokens logged; state bytes as a float64 tensor scalar that
        # float32 could not hold exactly.
        adamw.name: _write_run(
            adamw,
            list(range(1, 31)),
            0,
            memory_tag="memory/max_active(GiB)",
            tokens_per_step=4096,
            state_bytes=3_000_000_123,
            state_new_style=True,
        ),
        # Every other step (log_freq 2), CPU-style RSS, no tokens_seen, classic float32 scalar.
        adam_mini.name: _write_run(
            adam_mini,
            list(range(2, 25, 2)),
            1,
            memory_tag="memory/rss(GiB)",
            tokens_per_step=None,
            state_bytes=1_572_864,
            state_new_style=False,
        ),
    }
    return tb, adamw, adam_mini, expected


def _check_summary(summary: dict, exp: dict, last_k: int) -> None:
    tail = exp["losses"][-last_k:]
    assert summary["final_loss"] == pytest.approx(sum(tail) / len(tail), rel=1e-9)
    assert summary["final_loss_steps"] == len(tail)
    steady = exp["tps"][2:]  # the first two logged values cover the compile warm-up
    assert summary["mean_tps"] == pytest.approx(sum(steady) / len(steady), rel=1e-9)
    assert summary["peak_memory_gib"] == pytest.approx(max(exp["memory"]), rel=1e-9)
    assert summary["optimizer_state_bytes"] == exp["state_bytes"]
    assert summary["last_step"] == exp["last_step"]
    assert summary["tokens_seen"] == exp["tokens_seen"]


def test_command_line_writes_png_table_and_json(runs, tmp_path):
    tb, adamw, adam_mini, expected = runs
    out = tmp_path / "figs" / "compare.png"
    json_path = tmp_path / "summary.json"
    result = processes.run(
        [
            sys.executable,
            "-m",
            "torchtitan.tools.compare_runs",
            str(tb),
            "--out",
            str(out),
            "--last-k",
            "5",
            "--json",
            str(json_path),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr

    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size[0] >= 800 and 300 <= image.size[1] <= image.size[0]
        pixels = np.asarray(image.convert("L"), dtype=np.float32)
    assert pixels.std() > 5.0  # something was drawn, not a blank canvas

    summaries = json.loads(json_path.read_text())
    # The parent folder expands to its run folders in name order.
    assert [s["name"] for s in summaries] == [adamw.name, adam_mini.name]
    for summary in summaries:
        _check_summary(summary, expected[summary["name"]], last_k=5)
    assert summaries[0]["peak_memory_tag"] == "memory/max_active(GiB)"
    assert summaries[1]["peak_memory_tag"] == "memory/rss(GiB)"

    table = result.stdout
    for summary in summaries:
        row = next(line for line in table.splitlines() if line.startswith(summary["name"]))
        assert f"{summary['final_loss']:.4f}" in row
        assert f"{summary['mean_tps']:.1f}" in row
        assert f"{summary['peak_memory_gib']:.3f}" in row
        assert f"{summary['optimizer_state_bytes'] / 2**30:.3f}" in row
    assert "(rss)" in next(line for line in table.splitlines() if line.startswith(adam_mini.name))
    # The run without tokens_seen is named in a note.
    assert "throughput/tokens_seen" in result.stderr and adam_mini.name in result.stderr


def test_labels_json_to_stdout_and_last_k_beyond_the_run(runs, tmp_path, capsys):
    _, adamw, adam_mini, expected = runs
    code = main(
        [
            str(adam_mini),
            str(adamw),
            "--out",
            str(tmp_path / "c.png"),
            "--labels",
            "mini, adamw",
            "--last-k",
            "100",
            "--json",
        ]
    )
    assert code == 0
    summaries = json.loads(capsys.readouterr().out)  # only JSON on stdout
    assert [s["name"] for s in summaries] == ["mini", "adamw"]
    _check_summary(summaries[0], expected[adam_mini.name], last_k=100)
    _check_summary(summaries[1], expected[adamw.name], last_k=100)
    assert summaries[0]["final_loss_steps"] == len(expected[adam_mini.name]["losses"])


def test_resumed_run_keeps_the_latest_value_of_a_repeated_step(tmp_path, capsys):
    run = tmp_path / "20250101-000000_AdamW"
    with SummaryWriter(log_dir=str(run)) as w:
        for step, loss in [(1, 5.0), (2, 4.0), (3, 3.0)]:
            w.add_scalar("loss_metrics/global_avg_loss", loss, step)
    with SummaryWriter(log_dir=str(run), filename_suffix=".resumed") as w:
        for step, loss in [(3, 2.5), (4, 2.0)]:
            w.add_scalar("loss_metrics/global_avg_loss", loss, step)
    assert main([str(run), "--out", str(tmp_path / "c.png"), "--last-k", "2", "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["last_step"] == 4
    assert summary["final_loss"] == pytest.approx((2.5 + 2.0) / 2)
    assert summary["mean_tps"] is None and summary["optimizer_state_bytes"] is None


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    return err


def test_missing_directory_exits_2_with_one_line(tmp_path):
    result = processes.run(
        [
            sys.executable,
            "-m",
            "torchtitan.tools.compare_runs",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "c.png"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "does not exist" in result.stderr and "nope" in result.stderr
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda tb, run, tmp: [str(tmp / "empty")], "no TensorBoard event files"),
        (lambda tb, run, tmp: [str(tb), "--labels", "only-one"], "--labels gives 1 names for 2 runs"),
        (lambda tb, run, tmp: [str(tb), "--last-k", "0"], "--last-k must be at least 1"),
        (lambda tb, run, tmp: [str(tb), "--out", str(tmp / "c.jpg")], "must name a .png file"),
        (lambda tb, run, tmp: [str(tmp / "no_loss")], "has no 'loss_metrics/global_avg_loss'"),
    ],
)
def test_bad_input_is_one_line_user_error(runs, tmp_path, capsys, make_args, message):
    tb, adamw, _, _ = runs
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with SummaryWriter(log_dir=str(tmp_path / "no_loss")) as w:
        w.add_scalar("lr", 1e-3, 1)
    args = make_args(tb, adamw, tmp_path)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "c.png")]
    assert main(args) == 2
    assert message in _error_line(capsys)


def test_diverged_run_is_shown_as_diverged(tmp_path, capsys):
    run = tmp_path / "20250101-000000_AdamW"
    with SummaryWriter(log_dir=str(run)) as w:
        for step, loss in [(1, 5.0), (2, 4.0), (3, float("nan")), (4, float("nan"))]:
            w.add_scalar("loss_metrics/global_avg_loss", loss, step)
            w.add_scalar("grad_norm", loss, step)
    assert main([str(run), "--out", str(tmp_path / "c.png"), "--last-k", "2"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(run.name))
    assert "diverged at step 3" in row and "nan" not in row
    assert main([str(run), "--out", str(tmp_path / "c.png"), "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert summary["diverged_at_step"] == 3 and summary["final_loss"] is None


def test_a_run_that_trained_nothing_is_left_out_and_named(runs, capsys):
    # A finished job started again resumes at its last step and logs no training step: a folder of runs still
    # compares, without it.
    tb, adamw, adam_mini, _ = runs
    idle = tb / "20250102-000000_AdamW"
    with SummaryWriter(log_dir=str(idle)) as w:
        w.add_scalar("optimizer/state_bytes", 1.0, 0)
    assert main([str(tb), "--out", str(tb.parent / "c.png")]) == 0
    captured = capsys.readouterr()
    rows = [line.split()[0] for line in captured.out.splitlines() if line.startswith("2025")]
    assert sorted(rows) == sorted([adamw.name, adam_mini.name])
    assert f"left out run '{idle}'" in captured.err
