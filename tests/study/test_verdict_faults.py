"""What runs produce, however broken, never stops the report or the scale view: NaN and infinite scalars, missing or
empty metrics, seeds that varied nothing, one seed, a seed missing on one side, a diverged baseline. Each gap is
said in words (no "nan", "None" or "inf" on the page). Made-up runs through ``summarize_sweep``, the report's text
and the scale view; a few through every figure."""

from __future__ import annotations

import math
import random
import re

import pytest

from tests.study.test_study import TOKENS_PER_STEP, made_up_run
from torchtitan.study import statistics
from torchtitan.study.plan import DIVERGED, FAILED
from torchtitan.study.report import format_html, format_markdown
from torchtitan.study.run_folders import LOSS, TOKENS_SEEN, VALIDATION_LOSS, Series
from torchtitan.study.scale_report import format_scale_html, format_scale_markdown, summarize_scale
from torchtitan.study.summary import summarize_sweep

# A number the page could not say in words.
UNSAID = re.compile(r"\b(nan|NaN|None|inf|null)\b")
TAGS = (LOSS, VALIDATION_LOSS, "throughput/tps", "memory/rss(GiB)", "optimizer/state_bytes", TOKENS_SEEN)


def with_value(run, tag: str, value: float, index: int = -1):
    series = run.scalars[tag]
    values = list(series.values)
    values[index] = value
    run.scalars[tag] = Series(series.steps, tuple(values))
    return run


def pair(muon_scale: float = 0.9, seeds: int = 3, flat: bool = False, **kw) -> list:
    def jitter(s):
        return 0.0 if flat else 0.01 * s + 0.001 * s * s

    return [made_up_run("AdamW", s, 1.0 + jitter(s), **kw) for s in range(seeds)] + [
        made_up_run("Muon", s, muon_scale * (1.0 + 1.3 * jitter(s)), **kw) for s in range(seeds)
    ]


def page(report: dict) -> str:
    md = format_markdown(report)
    format_html(report, {}, "study")
    assert not UNSAID.search(md), [line for line in md.splitlines() if UNSAID.search(line)]
    return md


def row(md: str, first: str, last: bool = False) -> str:
    """The first table row whose first cell is ``first`` (the verdict's), or the last (in the scale view: the last
    optimizer's table)."""
    return [line for line in md.splitlines() if line.startswith(f"| {first} |")][-1 if last else 0]


@pytest.mark.parametrize("tag", [TAGS[2], TAGS[3], TAGS[4], TAGS[5]])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_throughput_memory_or_count_is_left_out(tag, value):
    runs = pair()
    with_value(runs[4], tag, value)
    report = summarize_sweep(runs, last_k=3)
    muon = report["best"]["Muon"]
    assert all(math.isfinite(muon[k]) for k in ("mean_tps", "peak_memory_gib", "optimizer_state_bytes"))
    clean = summarize_sweep(pair(), last_k=3)["best"]["Muon"]
    assert (muon["versus_baseline"], muon["speedup"]) == (clean["versus_baseline"], clean["speedup"])
    page(report)


@pytest.mark.parametrize("validation", [True, False], ids=["validation", "training"])
def test_a_finished_run_with_a_nan_loss_is_a_diverged_seed_said_so(validation):
    runs = pair(validation=validation)
    with_value(runs[4], VALIDATION_LOSS if validation else LOSS, math.nan, 1)
    report = summarize_sweep(runs, last_k=3)
    (seed1,) = [r for r in report["runs"] if r["optimizer"] == "Muon" and r["seed"] == 1]
    assert seed1["outcome"] == DIVERGED and "exited 0 but logged a non-finite loss at step" in seed1["message"]
    assert report["best"]["Muon"]["settings"] is None  # its only cell had a diverged seed
    md = page(report)
    assert "diverged 1/3 seeds" in md and "exited 0 but logged a non-finite loss" in md


def test_a_finished_run_that_logged_nothing_is_a_failed_seed_said_so():
    runs = pair()
    runs[1].scalars.clear()
    report = summarize_sweep(runs, last_k=3)
    (seed1,) = [r for r in report["runs"] if r["optimizer"] == "AdamW" and r["seed"] == 1]
    assert seed1["outcome"] == FAILED and seed1["message"].startswith("exited 0 but logged no ")
    md = page(report)
    assert "failed 1/3 seeds" in md and "exited 0 but logged no validation/loss: nothing to rank" in md
    assert report["best"]["Muon"]["versus_baseline"] is None
    assert "no verdict: every setting of AdamW had a seed that diverged or failed" in row(md, "Muon")


def test_seeds_that_varied_nothing_reach_the_scale_view_as_words():
    sizes = [
        {"size": name, "params": n, "folder": name, "report": summarize_sweep(pair(flat=True), last_k=3)}
        for name, n in (("small", 3e7), ("large", 6e7))
    ]
    view = summarize_scale(sizes, {}, "AdamW", 8e9)
    md = format_scale_markdown(view)
    format_scale_html(view, None, "study")
    assert not UNSAID.search(md)
    assert "(no interval: no spread, paired), no verdict: the seeds varied nothing" in row(md, "small", last=True)


def test_a_d_eff_interval_without_a_lower_end_reads_as_zero_with_its_reason():
    steps = (20, 40, 80)
    runs = []
    for steps_ in steps:
        tokens = steps_ * TOKENS_PER_STEP
        runs += pair(steps=steps_, budget=tokens)
    report = summarize_sweep(runs, last_k=3)
    (entry,) = [e for e in report["budget_fit"]["speedups"]["Muon"] if e["budget"] == steps[1] * TOKENS_PER_STEP]
    entry["interval"] = [None, 2.0]  # as budget_fit gives it when the failed resamples alone reach past the end
    entry["interval_note"] = "no lower end: 40 of 1000 resamples found no power law"
    assert "[0, 2.00] paired (no lower end: 40 of 1000 resamples found no power law)" in page(report)
    view = summarize_scale([{"size": "s", "params": 3e7, "folder": "s", "report": report}], {}, "AdamW", 8e9)
    md = format_scale_markdown(view)
    format_scale_html(view, None, "study")
    assert "[0, 2.00] (no lower end: 40 of 1000 resamples found no power law)" in row(md, "s", last=True)
    assert not UNSAID.search(md)


def test_a_baseline_with_no_run_at_the_largest_budget_gives_a_verdict_in_words():
    runs = pair(steps=20, budget=20 * TOKENS_PER_STEP) + [
        made_up_run("Muon", s, 1.0 + 0.01 * s, steps=40, budget=40 * TOKENS_PER_STEP) for s in range(3)
    ]
    md = page(summarize_sweep(runs, last_k=3))
    assert "no verdict: AdamW has no run at this budget" in row(md, "Muon")


def made_up_faulty_study(rng: random.Random) -> list:
    """Two optimizers, one budget or three, one to three seeds; each run, with some chance, one fault: a NaN or
    infinite scalar (or all of a tag's values NaN), a tag dropped, its metrics empty, a diverged or failed status;
    a seed missing on one side, a cell whose seeds varied nothing."""
    budgets = rng.choice([[None], [20 * TOKENS_PER_STEP, 40 * TOKENS_PER_STEP, 80 * TOKENS_PER_STEP]])
    seeds = rng.choice([1, 2, 3])
    runs = []
    for optimizer, base in (("AdamW", 1.0), ("Muon", rng.choice([0.8, 1.0, 1.2]))):
        for budget in budgets:
            steps = 20 if budget is None else budget // TOKENS_PER_STEP
            flat = rng.random() < 0.15
            for s in range(seeds):
                if rng.random() < 0.1:
                    continue
                scale = base * (1 + (0 if flat else 0.01 * s + 0.003 * rng.random())) * steps / 20
                runs.append(made_up_run(optimizer, s, scale, steps=steps, budget=budget, validation=rng.random() < 0.5))
    for run in runs:
        if rng.random() >= 0.3:
            continue
        fault = rng.choice(["nan", "inf", "all nan", "drop", "empty", DIVERGED, FAILED])
        tag = rng.choice([t for t in TAGS if t in run.scalars])
        values = list(run.scalars[tag].values)
        if fault in ("nan", "inf"):
            with_value(run, tag, math.nan if fault == "nan" else math.inf, rng.randrange(len(values)))
        elif fault == "all nan":
            run.scalars[tag] = Series(run.scalars[tag].steps, (math.nan,) * len(values))
        elif fault == "drop":
            del run.scalars[tag]
        elif fault == "empty":
            run.scalars.clear()
        else:
            run.status.update(outcome=fault, exit_code=3 if fault == DIVERGED else 1)
    return runs


def test_a_fuzz_of_faulty_run_folders_never_stops_the_report_or_the_scale_view():
    # 60 made-up studies of three sizes each: every report and scale view is written, and says every gap in words.
    for study in range(60):
        rng = random.Random(study)
        sizes = []
        for k, params in enumerate((3e7, 6e7, 1.2e8)):
            report = summarize_sweep(made_up_faulty_study(rng), last_k=3)
            page(report)
            sizes.append({"size": f"size{k}", "params": params, "folder": f"size{k}", "report": report})
        view = summarize_scale(sizes, {}, "AdamW", 8e9)
        md = format_scale_markdown(view)
        format_scale_html(view, None, "study")
        assert not UNSAID.search(md), (study, [line for line in md.splitlines() if UNSAID.search(line)])


def test_faulty_runs_draw_every_figure(tmp_path):
    from torchtitan.study.figures import plot_budgets, plot_main, plot_sensitivity, plot_study_health, plot_sweep
    from torchtitan.study.scale_report import plot_scale

    rng = random.Random(3)  # draws a zero-spread difference and a NaN throughput among its sizes
    sizes = []
    for k, params in enumerate((3e7, 6e7, 1.2e8)):
        runs = made_up_faulty_study(rng)
        report = summarize_sweep(runs, last_k=3)
        sizes.append({"size": f"size{k}", "params": params, "folder": f"size{k}", "report": report})
    plot_main(runs, report), plot_sensitivity(report), plot_budgets(report), plot_study_health(runs, report)
    plot_sweep(runs, report, tmp_path / "sweep.png")
    assert plot_scale(summarize_scale(sizes, {}, "AdamW", 8e9)) is not None


def test_the_statistics_refuse_non_finite_numbers():
    # The report leaves them out before; a NaN reaching a statistic is a bug, not a NaN interval.
    for call in (
        lambda: statistics.paired_difference([1.0, math.nan], [1.0, 2.0]),
        lambda: statistics.welch_difference([1.0, 2.0], [math.inf, 2.0]),
        lambda: statistics.holm_adjusted([0.01, math.nan]),
        lambda: statistics.combine_speedups([(math.nan, None), (1.0, None)]),
    ):
        with pytest.raises(ValueError, match="finite"):
            call()
