"""Optimizer health on the study page and in compare_runs: drawn at each optimizer's best settings from the runs'
health tags, and said to be absent when no run logged them."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from PIL import Image

from tests.study.test_study import made_up_run, write_jsonl_run
from torchtitan.study.figures import HEALTH_PANELS, _health_curve, plot_health
from torchtitan.study.report import write_report
from torchtitan.study.run_folders import Series
from torchtitan.telemetry.metrics import MetricLogger
from torchtitan.tools.compare_runs import health_path, main

GROUPS = [group for _, groups in HEALTH_PANELS for group in groups]


def with_health(run, scale: float):
    """``run`` with health logged every 5 steps: update RMS ``scale`` x 1e-3 / step per group, the logit growing."""
    steps = tuple(s for s in run.scalars["loss_metrics/global_avg_loss"].steps if s % 5 == 0)
    scalars = dict(run.scalars)
    for group in [*GROUPS, "all"]:
        scalars[f"health/update_rms/{group}"] = Series(steps, tuple(scale * 1e-3 / s for s in steps))
        scalars[f"health/update_to_weight/{group}"] = Series(steps, tuple(scale * 1e-2 / s for s in steps))
    scalars["health/attn_logit_max"] = Series(steps, tuple(1.0 + scale * s for s in steps))
    scalars["health/weight_norm/all"] = Series(steps, tuple(100.0 + s for s in steps))
    return dataclasses.replace(run, scalars=scalars)


def test_health_curves_are_the_mean_over_seeds_at_common_steps():
    a = {"t": Series((5, 10, 15), (1.0, 2.0, 3.0))}
    b = {"t": Series((5, 10), (3.0, 4.0))}
    assert _health_curve([a, b], "t") == ([5, 10], [2.0, 3.0])
    assert _health_curve([a, {}], "t") is None  # a seed without it: no mean to draw


def test_the_health_figure_needs_health_tags():
    plain = made_up_run("AdamW", 0, 1.0).scalars
    assert plot_health([("AdamW", [plain])]) is None
    png = plot_health([("AdamW", [with_health(made_up_run("AdamW", 0, 1.0), 1.0).scalars])])
    assert Image.open(io.BytesIO(png)).size == (2200, 800)


@pytest.mark.parametrize("health", [True, False])
def test_the_study_page_shows_health_at_the_best_settings(tmp_path, health):
    for optimizer, scale in (("AdamW", 1.0), ("Muon", 2.0)):
        for lr in (1e-3, 3e-3):
            run = made_up_run(optimizer, 0, scale * (1.0 if lr == 1e-3 else 1.5), lr=lr)
            run = with_health(run, scale) if health else run
            write_jsonl_run(tmp_path / "runs" / run.spec.name, run)
    write_report(tmp_path, last_k=3)
    page = (tmp_path / "study.html").read_text()
    section = page[page.index("<h2>Optimizer health</h2>") : page.index("<h2>Overview</h2>")]
    if health:
        assert "<img" in section and "update RMS and update/weight per group" in section
    else:
        assert "<img" not in section and "no run at the best settings logged optimizer health" in section


def test_compare_runs_writes_the_health_figure_beside_its_own(tmp_path, capsys):
    for optimizer, scale in (("AdamW", 1.0), ("AdamMini", 1.5)):
        run = with_health(made_up_run(optimizer, 0, scale), scale)
        logger = MetricLogger(str(tmp_path / optimizer / "tb" / f"20260101-000000_{optimizer}"), True)
        by_step: dict[int, dict] = {}
        for tag, series in run.scalars.items():
            for step, value in zip(series.steps, series.values):
                by_step.setdefault(step, {})[tag] = value
        for step, metrics in sorted(by_step.items()):
            logger.log(metrics, step)
        logger.close()
    out = tmp_path / "compare.png"
    assert main([str(tmp_path / "AdamW"), str(tmp_path / "AdamMini"), "--out", str(out)]) == 0
    assert health_path(out) == tmp_path / "compare_health.png"
    assert Image.open(health_path(out)).size == (2200, 800)
    assert re.search(r"wrote .*compare_health.png \(optimizer health\)", capsys.readouterr().out)
