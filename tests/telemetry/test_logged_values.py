"""The numbers a run logs: TensorBoard, metrics.jsonl and the printed log line agree, and each is the right number.

One short train.py run (5 steps, 2 micro-batches per step, a log every 2 steps and at the last one) serves every
check; compare_runs then reads that very run folder.
"""

from __future__ import annotations

import json
import math
import re
import time

import numpy as np
import pytest

from tests.distributed import memory_tag
from tests.helpers import DEBUG_RUN, PER_STEP_TAGS, metric_rows, run_dir, train
from torchtitan.config.job_config import JobConfig
from torchtitan.study.summary import TPS_WARMUP_LOGS
from torchtitan.tools.compare_runs import main as compare_main
from torchtitan.training.lr_scheduling import lr_factor, schedule_options

EXTRA = ["--training.steps", "5", "--training.gradient_accumulation_steps", "2", "--metrics.log_freq", "2"]
LOGGED_STEPS = [2, 4, 5]  # every log_freq steps, and the last step
LOG_LINE = re.compile(
    r"step:\s+(?P<step>\d+)\s+loss: (?P<loss>\S+)\s+grad_norm: (?P<grad_norm>\S+)\s+lr: (?P<lr>\S+)\s+tps: (?P<tps>\S+)"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = tmp_path_factory.mktemp("logged")
    start = time.perf_counter()
    proc = train(dump, *EXTRA)
    wall_s = time.perf_counter() - start
    folder = run_dir(dump)
    rows = metric_rows(folder)
    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    printed = {int(m["step"]): m for m in LOG_LINE.finditer(proc.stderr)}
    return {
        "dump": dump,
        "folder": folder,
        "rows": rows,
        "scalars": scalars,
        "printed": printed,
        "wall_s": wall_s,
        "job": JobConfig.parse_args(DEBUG_RUN + EXTRA),
    }


def per_step(run: dict) -> dict[int, dict]:
    return {row["step"]: row for row in run["rows"] if "loss_metrics/global_avg_loss" in row}


def test_every_logged_step_is_in_jsonl_tensorboard_and_the_log(run):
    steps = per_step(run)
    assert sorted(steps) == LOGGED_STEPS
    assert sorted(run["printed"]) == LOGGED_STEPS
    for tag in PER_STEP_TAGS + [memory_tag()]:
        assert sorted(run["scalars"][tag]) == LOGGED_STEPS, tag


def test_tensorboard_holds_the_jsonl_values(run):
    for step, row in per_step(run).items():
        for tag in PER_STEP_TAGS + [memory_tag()]:
            # TensorBoard scalars are float32.
            assert run["scalars"][tag][step] == np.float32(row[tag]), (tag, step)
    (state_row,) = [row for row in run["rows"] if "optimizer/state_bytes" in row]
    assert state_row["step"] == 0
    assert run["scalars"]["optimizer/state_bytes"] == {0: np.float32(state_row["optimizer/state_bytes"])}


def test_the_log_line_prints_the_jsonl_values(run):
    for step, row in per_step(run).items():
        line = run["printed"][step]
        assert line["loss"] == f"{row['loss_metrics/global_avg_loss']:.8f}"
        assert line["grad_norm"] == f"{row['grad_norm']:.4f}"
        assert line["lr"] == f"{row['lr']:.4e}"
        assert line["tps"] == f"{row['throughput/tps']:,.0f}"


def test_values_are_what_the_job_implies(run):
    t, job = run["job"].training, run["job"]
    tokens_per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps  # one data-parallel rank
    assert tokens_per_step == 2 * 32 * 2
    window_seconds = 0.0
    previous = 0
    for step, row in sorted(per_step(run).items()):
        # The lr the step trained with: the schedule's value for this step.
        expected_lr = job.optimizer.lr * lr_factor(step, **schedule_options(t))
        assert row["lr"] == pytest.approx(expected_lr, rel=1e-12), step
        assert row["throughput/tokens_seen"] == step * tokens_per_step
        # One process: the mean and the max over ranks are that process's loss.
        assert row["loss_metrics/global_max_loss"] == row["loss_metrics/global_avg_loss"]
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert row[memory_tag()] > 0
        tps = row["throughput/tps"]
        assert math.isfinite(tps) and tps > 0
        window_seconds += (step - previous) * tokens_per_step / tps
        previous = step
    # The time the logged tps imply for the steps is a part of the process's own run time.
    assert 0 < window_seconds < run["wall_s"]
    # Warmup then linear decay: the logged lr rises to the peak, then falls.
    lrs = [per_step(run)[s]["lr"] for s in LOGGED_STEPS]
    assert lrs[0] == pytest.approx(job.optimizer.lr) and lrs[0] > lrs[1] > lrs[2] > 0


def test_compare_runs_reads_the_real_run(run, tmp_path, capsys):
    out_json, out_png = tmp_path / "summary.json", tmp_path / "compare.png"
    assert compare_main([str(run["dump"] / "tb"), "--out", str(out_png), "--json", str(out_json), "--last-k", "2"]) == 0
    table = capsys.readouterr().out
    (summary,) = json.loads(out_json.read_text())
    steps = per_step(run)
    assert summary["name"] in table and summary["path"] == str(run["folder"])
    assert summary["last_step"] == 5
    last_two = [steps[s]["loss_metrics/global_avg_loss"] for s in (4, 5)]  # metrics.jsonl: full precision
    assert summary["final_loss"] == pytest.approx(sum(last_two) / 2, rel=1e-12)
    assert summary["final_loss_steps"] == 2
    tps = [steps[s]["throughput/tps"] for s in LOGGED_STEPS][TPS_WARMUP_LOGS:]  # after the compile warm-up
    assert tps and summary["mean_tps"] == pytest.approx(sum(tps) / len(tps), rel=1e-12)
    assert summary["tokens_seen"] == steps[5]["throughput/tokens_seen"]
    assert summary["peak_memory_tag"] == memory_tag()
    (state_row,) = [row for row in run["rows"] if "optimizer/state_bytes" in row]
    assert summary["optimizer_state_bytes"] == pytest.approx(state_row["optimizer/state_bytes"], rel=1e-7)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
