"""The study's statistics and verdict: t quantiles, Welch's interval, speedup at matched loss, the budget fit, the
data check, and the report page, all on made-up runs (no trainer)."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from torchtitan.errors import UserError
from torchtitan.study import statistics
from torchtitan.study.figures import plot_budgets, swept_hyperparameters
from torchtitan.study.plan import RunSpec, check_train_options, run_command
from torchtitan.study.report import format_html, format_markdown, grid_rows
from torchtitan.study.run_folders import (
    LOSS,
    TOKENS_SEEN,
    VALIDATION_LOSS,
    Series,
    SweepRun,
    merged_scalars,
    read_metrics_jsonl,
    read_scalars,
)
from torchtitan.study.summary import summarize_sweep
from torchtitan.tools.sweep import main

TOKENS_PER_STEP = 512


# ----------------------------------------------------------------------------------------------------------------
# Student's t and Welch


@pytest.mark.parametrize(
    "df, t975, t995",
    # Two-sided 95% and 99% critical values from the standard t table.
    [
        (1, 12.706, 63.657),
        (2, 4.303, 9.925),
        (3, 3.182, 5.841),
        (5, 2.571, 4.032),
        (10, 2.228, 3.169),
        (30, 2.042, 2.750),
    ],
)
def test_t_quantile_matches_the_table(df, t975, t995):
    assert statistics.t_quantile(0.975, df) == pytest.approx(t975, abs=6e-4)
    assert statistics.t_quantile(0.995, df) == pytest.approx(t995, abs=6e-4)
    assert statistics.t_quantile(0.025, df) == pytest.approx(-t975, abs=6e-4)


def test_t_quantile_for_fractional_and_large_df():
    # Welch's df is not whole: the quantile falls between its neighbours and tends to the normal's 1.95996.
    assert statistics.t_quantile(0.975, 2) > statistics.t_quantile(0.975, 2.5) > statistics.t_quantile(0.975, 3)
    assert statistics.t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert statistics.t_quantile(0.5, 4.2) == pytest.approx(0.0, abs=1e-12)


def test_welch_difference_and_its_verdict():
    # Equal sizes and spreads: df = 2 (n - 1), half-width t * sqrt(2 s^2 / n) = 2.776 * sqrt(2/3).
    d = statistics.welch_difference([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert d.difference == -3.0 and d.df == pytest.approx(4.0)
    assert (d.low, d.high) == pytest.approx((-3 - 2.776445 * math.sqrt(2 / 3), -3 + 2.776445 * math.sqrt(2 / 3)))
    assert d.verdict == "better"
    assert statistics.welch_difference([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]).verdict == "worse"
    # Unequal spreads: Welch-Satterthwaite df = (0.41667 + 25)^2 / (0.41667^2 / 3 + 25^2 / 1) = 1.0335.
    d = statistics.welch_difference([1.0, 2.0, 3.0, 4.0], [10.0, 20.0])
    assert d.df == pytest.approx(1.03355, abs=1e-4)
    assert d.verdict == "no detectable difference" and d.low < 0 < d.high
    assert statistics.welch_difference([1.0], [1.0, 2.0]) is None  # one seed: no interval
    same = statistics.welch_difference([2.0, 2.0], [3.0, 3.0])  # no spread at all: no interval, no verdict
    assert (same.low, same.high, same.df, same.verdict) == (None, None, None, "no verdict: the seeds varied nothing")


# ----------------------------------------------------------------------------------------------------------------
# Speedup at matched loss


def test_tokens_to_reach_interpolates_and_bounds():
    tokens, losses = [100, 200, 300, 400], [4.0, 3.0, 2.5, 2.0]
    assert statistics.tokens_to_reach(tokens, losses, 2.75) == statistics.Reach(250.0, None)
    assert statistics.tokens_to_reach(tokens, losses, 2.0) == statistics.Reach(400.0, None)
    assert statistics.tokens_to_reach(tokens, losses, 1.9) == statistics.Reach(400.0, ">")  # never got there
    assert statistics.tokens_to_reach(tokens, losses, 5.0) == statistics.Reach(100.0, "<")  # there from the start
    # The first crossing counts, even where the curve goes up again later.
    assert statistics.tokens_to_reach([1, 2, 3, 4], [3.0, 2.0, 2.6, 1.5], 2.5).tokens == pytest.approx(1.5)


def test_speedup_over_seeds():
    curve = ([100.0, 200.0, 300.0, 400.0], [4.0, 3.0, 2.5, 2.0])
    # Reaching the baseline's 400-token loss in 200 tokens is a 2x speedup; 3.0 in 200 tokens is 1x.
    one = statistics.speedup_at_matched_loss([curve], [(2.0, 200.0)])
    assert (one.value, one.bound, one.low, one.high) == (2.0, None, None, None)
    seeds = statistics.speedup_at_matched_loss([curve] * 3, [(2.0, 200.0), (2.5, 200.0), (3.0, 200.0)])
    assert seeds.value == pytest.approx((2.0 * 1.5 * 1.0) ** (1 / 3))  # geometric mean
    logs = [math.log(2.0), math.log(1.5), 0.0]
    half = statistics.t_quantile(0.975, 2) * math.sqrt(statistics.sample_variance(logs) / 3)
    assert (seeds.low, seeds.high) == pytest.approx((seeds.value * math.exp(-half), seeds.value * math.exp(half)))
    # A seed the baseline never matches makes the whole a lower bound that every seed supports: seed 0 is exactly
    # 2x, seed 1 at least 4x, so the study can claim "at least 2x", never "at least 4x" (seed 0 says otherwise).
    bound = statistics.speedup_at_matched_loss([curve] * 2, [(2.0, 200.0), (1.0, 100.0)])
    assert (bound.value, bound.bound, bound.low) == (2.0, "≥", None)
    assert bound.per_seed == ((2.0, None), (4.0, ">"))
    upper = statistics.speedup_at_matched_loss([curve], [(9.0, 400.0)])
    assert (upper.value, upper.bound) == (0.25, "≤")


def test_a_speedup_bound_is_never_one_a_seed_contradicts():
    # Seed 0 reaches the baseline's final loss at 0.80 of its tokens; seed 1 ends below anything the baseline
    # reached (at least 1.00x). The combined figure is at least 0.80x: ">1.00x" would contradict seed 0.
    combined = statistics.combine_speedups([(0.8, None), (1.0, ">")])
    assert (combined.value, combined.bound) == (0.8, "≥")
    assert all(combined.value <= ratio for ratio, _ in combined.per_seed)
    assert statistics.combine_speedups([(1.3, None), (0.9, "<")]).value == 1.3  # every seed at most 1.3x
    mixed = statistics.combine_speedups([(1.2, ">"), (0.7, "<"), (1.0, None)])  # bounded both ways: no one figure
    assert (mixed.value, mixed.bound) == (None, "mixed")


def test_paired_difference_matches_a_published_example():
    # Student's sleep data (Cushny & Peebles, as in R's t.test(extra ~ group, paired = TRUE)): mean difference
    # -1.58, 95% interval [-2.4598858, -0.7001142], df 9.
    group1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    group2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    d = statistics.paired_difference(group1, group2)
    assert (d.difference, d.low, d.high, d.df) == pytest.approx((-1.58, -2.4598858, -0.7001142, 9), abs=1e-6)
    assert (d.method, d.verdict) == ("paired", "better")
    # The same numbers unpaired (Welch, R: [-3.3654832, 0.2054832]) see no difference: pairing removes the
    # seed-to-seed spread that both sides share.
    w = statistics.welch_difference(group1, group2)
    assert (w.low, w.high) == pytest.approx((-3.3654832, 0.2054832), abs=1e-6)
    assert (w.method, w.verdict) == ("Welch", "no detectable difference")
    assert statistics.paired_difference([1.0], [2.0]) is None


def test_trailing_mean_ends_at_the_final_training_loss():
    values = [5.0, 4.0, 3.0, 2.0, 1.0]
    assert statistics.trailing_mean(values, 3) == [5.0, 4.5, 4.0, 3.0, 2.0]
    assert statistics.trailing_mean(values, 3)[-1] == sum(values[-3:]) / 3


# ----------------------------------------------------------------------------------------------------------------
# The budget fit


def test_power_law_fit_recovers_its_parameters():
    budgets = [1e6, 3e6, 1e7, 3e7, 1e8]
    losses = [40.0 * d**-0.3 + 2.1 for d in budgets]
    fit = statistics.fit_power_law(budgets, losses)
    assert (fit.alpha, fit.beta, fit.gamma) == pytest.approx((40.0, 0.3, 2.1), rel=1e-6)
    assert fit.tokens_for(fit.loss(5e6)) == pytest.approx(5e6, rel=1e-9)
    assert fit.tokens_for(2.0) == math.inf  # below the floor: no budget gets there
    three = statistics.fit_power_law(budgets[:3], losses[:3])  # three budgets: an exact fit
    assert three.beta == pytest.approx(0.3, rel=1e-5) and three.rms_residual < 1e-9
    assert statistics.fit_power_law(budgets[:2], losses[:2]) is None
    assert statistics.fit_power_law(budgets[:3], [2.0, 2.5, 3.0]) is None  # loss rising with the budget
    # Falling linearly in log D: the best "power law" has beta at the scan's end and a floor far below zero.
    assert statistics.fit_power_law(budgets, [5.0 - 0.5 * math.log(d) for d in budgets]) is None


# ----------------------------------------------------------------------------------------------------------------
# A study from made-up runs


def made_up_run(
    optimizer: str,
    seed: int,
    scale: float,
    lr: float = 1e-3,
    steps: int = 20,
    validation: bool = True,
    budget=None,
    options=None,
    dataset=None,
    outcome: str = "finished",
    data_seed=None,
) -> SweepRun:
    """Loss = 2 + scale * 8 / step (validation the same every 5 steps), 512 tokens a step."""
    steps_ = tuple(range(1, steps + 1))
    loss = tuple(2.0 + scale * 8.0 / s for s in steps_)
    scalars = {
        LOSS: Series(steps_, loss),
        TOKENS_SEEN: Series(steps_, tuple(float(s * TOKENS_PER_STEP) for s in steps_)),
        "throughput/tps": Series(steps_, (1000.0,) * steps),
        "memory/rss(GiB)": Series(steps_, (0.5,) * steps),
        "optimizer/state_bytes": Series((0,), (2.0**20,)),
    }
    if validation:
        val_steps = tuple(s for s in steps_ if s % 5 == 0)
        scalars[VALIDATION_LOSS] = Series(val_steps, tuple(2.0 + scale * 8.0 / s for s in val_steps))
    status = {"optimizer": optimizer, "lr": lr, "seed": seed, "outcome": outcome, "exit_code": 0, "ended": 0.0}
    if budget is not None:
        status["budget"] = budget
    if options:
        status["options"] = options
    if data_seed is not None:
        status["data_seed"] = data_seed
    return SweepRun(RunSpec(optimizer, lr, seed), status, scalars, dataset)


def test_significance_and_mean_ci_per_cell():
    # AdamW's final validation losses 2.40 +- 0.01 over three seeds; Muon 0.2 lower, Lion 0.2 higher, AdamMini within
    # the seed noise; each seed's noise is shared, plus a little of each run's own (mean 0 over the seeds).
    jitter, own = [-0.01, 0.0, 0.01], [0.0002, -0.0001, -0.0001]
    runs = []
    for optimizer, shift in (("AdamW", 0.0), ("Muon", -0.2), ("Lion", 0.2), ("AdamMini", 0.005)):
        mine = [0.0] * 3 if optimizer == "AdamW" else own
        runs += [made_up_run(optimizer, s, (0.4 + shift + jitter[s] + mine[s]) / 0.4) for s in range(3)]
    report = summarize_sweep(runs, last_k=3)
    best = report["best"]
    assert report["seeds"] == 3 and report["by_validation"]
    # The last validation loss is 2 + scale * 8 / 20 = 2.4 + shift + jitter: sample sd 0.01 over three seeds.
    assert best["AdamW"]["loss_mean"] == pytest.approx(2.4)
    assert best["AdamW"]["loss_ci"] == pytest.approx(4.302653 * 0.01 / math.sqrt(3), rel=1e-6)
    assert best["Muon"]["versus_baseline"]["verdict"] == "better"
    assert best["Lion"]["versus_baseline"]["verdict"] == "worse"
    # AdamMini's runs share each seed's noise with AdamW's (same seeds): the paired interval sees its 0.005 excess,
    # where Welch's, blind to the pairing, would not.
    assert best["AdamMini"]["versus_baseline"]["method"] == "paired"
    assert best["AdamMini"]["versus_baseline"]["verdict"] == "worse"
    assert best["AdamMini"]["versus_baseline"]["difference"] == pytest.approx(0.005)
    assert best["Muon"]["versus_baseline"]["difference"] == pytest.approx(-0.2)
    md = format_markdown(report)
    row = next(line for line in md.splitlines() if line.startswith("| Muon | lr 1e-3 |"))
    assert f"{best['Muon']['loss_mean']:.4f} ± {best['Muon']['loss_ci']:.4f} (3 seeds)" in row
    assert "(paired, unadjusted 95%), better (Holm p = " in row and "family of 3)" in row
    assert "Seeds varied: model initialisation (training.seed); data order fixed" in md


def test_one_seed_says_so_instead_of_a_verdict():
    """sweep.md starts with the answer; one seed and one lr leave out what they cannot judge (the verdict, which
    seeds chose the settings)."""
    report = summarize_sweep([made_up_run("AdamW", 0, 1.0), made_up_run("Muon", 0, 0.5)], last_k=3)
    assert report["best"]["Muon"]["versus_baseline"] is None
    md = format_markdown(report)
    first = md.splitlines()[0]
    assert first.startswith("Lowest loss first: Muon 2.2000 (lr 1e-3), AdamW ") and "cannot be judged" in first
    assert "One seed per cell: no confidence intervals and no verdict" in md
    assert "| Muon | lr 1e-3 | 2.2000 (1 seed) | 2.00× (paired) |" in md  # no difference column
    assert "vs baseline" not in md and "favours" not in md and "chosen and tested" not in md
    assert "how sure" not in md and "quadratic" not in md and "one setting per optimizer: nothing was chosen" in md
    assert "better" not in md and "worse" not in md


def test_with_seeds_the_answer_gives_each_difference_from_the_baseline():
    runs = [
        made_up_run(o, seed, scale * (1 + 0.01 * seed))
        for o, scale in (("AdamW", 1.0), ("Muon", 0.5))
        for seed in (0, 1, 2)
    ]
    first = format_markdown(summarize_sweep(runs, last_k=3)).splitlines()[0]
    assert first.startswith("Lowest loss first: Muon ") and "Against AdamW: Muon: " in first and "better" in first


def test_speedup_at_matched_loss_along_the_validation_curve():
    # AdamW's validation loss 2 + 8/step at steps 5, 10, 15, 20. Muon (scale 0.5) ends at 2 + 4/20 = 2.2, which AdamW
    # never reaches (its last is 2.4): read the other way, Muon's own curve is at AdamW's 2.4 at step 10, a speedup
    # of 20 / 10. Slow (scale 1.5) ends at 2.6, which AdamW passes between step 15 (2.5333) and step 10 (2.8): at
    # step 10 + 5 * (2.8 - 2.6) / (2.8 - 2.5333) = 13.75.
    runs = [made_up_run("AdamW", 0, 1.0), made_up_run("Muon", 0, 0.5), made_up_run("Slow", 0, 1.5)]
    best = summarize_sweep(runs, last_k=3)["best"]
    assert best["AdamW"]["speedup"]["value"] == 1.0 and best["AdamW"]["speedup"]["bound"] is None
    assert (best["Muon"]["speedup"]["value"], best["Muon"]["speedup"]["bound"]) == (pytest.approx(2.0), None)
    assert best["Slow"]["speedup"]["value"] == pytest.approx((10 + 5 * 0.2 / (0.8 - 8 / 15)) / 20)
    assert best["Slow"]["speedup"]["matched"] == "paired on (training seed, data seed)"
    md = format_markdown(summarize_sweep(runs, last_k=3))
    assert "| 2.00× (paired) |" in next(line for line in md.splitlines() if line.startswith("| Muon |"))


def test_speedup_along_the_smoothed_training_loss_with_seeds():
    # Without validation the final loss is the mean of the last k training losses; the baseline's raw curve is read
    # at the same k steps' tokens scaled by the speedup (statistics.matched_ratio); with seeds a CI.
    runs = [
        made_up_run(o, s, scale * (1 + luck * s), validation=False)
        for o, scale, luck in (("AdamW", 1.0, 0.01), ("Slower", 1.25, 0.02))
        for s in range(3)
    ]
    report = summarize_sweep(runs, last_k=4)
    assert not report["by_validation"] and "trailing mean of the last 4" in report["curve"]
    s = report["best"]["Slower"]["speedup"]
    per_seed = []
    tokens = [512.0 * k for k in range(1, 21)]
    for seed in range(3):
        base = [2.0 + (1 + 0.01 * seed) * 8.0 / step for step in range(1, 21)]
        mine = statistics.mean([2.0 + 1.25 * (1 + 0.02 * seed) * 8.0 / step for step in range(17, 21)])
        ratio, bound = statistics.matched_ratio(tokens, base, tokens[-4:], mine)
        assert bound is None
        per_seed.append(ratio)
    assert s["value"] == pytest.approx(math.prod(per_seed) ** (1 / 3)) and s["low"] < s["value"] < s["high"]
    # 2 + 1.25 c 8 / t is 2 + c 8 / t' at t' = 0.8 t: seed 0's speedup is 0.8 (up to the interpolation of 1/t).
    assert s["bound"] is None and s["seeds"] == 3 and per_seed[0] == pytest.approx(0.8, abs=0.002)


def test_speedup_of_seeds_the_baseline_did_not_run_pairs_every_seed_with_every_seed():
    runs = [made_up_run("AdamW", s, 1.0 + 0.02 * s) for s in range(2)] + [made_up_run("Slow", 5, 1.5)]
    s = summarize_sweep(runs, last_k=3)["best"]["Slow"]["speedup"]
    assert s["matched"] == "unpaired: each seed against each of the baseline's (Welch)"
    steps = (5, 10, 15, 20)
    ratios = [
        statistics.tokens_to_reach([512.0 * k for k in steps], [2.0 + c * 8.0 / k for k in steps], 2.6).tokens / 10240
        for c in (1.0, 1.02)
    ]
    assert s["value"] == pytest.approx(math.sqrt(ratios[0] * ratios[1])) and s["low"] is None  # one seed of Slow


def test_the_budget_fit_and_speedup_per_budget():
    # AdamW's best loss at budget D: 40 * D^-0.3 + 2.1 (steps = D / 512); Muon reaches at each budget what AdamW's law
    # gives at 1.5 x that budget: D_eff / D = 1.5 everywhere.
    runs = []
    for steps in (20, 40, 80, 160):
        tokens = steps * TOKENS_PER_STEP

        def scale(d, steps=steps):
            # loss at the last validation step (= steps) is 2 + scale * 8 / steps
            return (40.0 * d**-0.3 + 0.1) * steps / 8.0

        for seed in range(2):
            runs.append(made_up_run("AdamW", seed, scale(tokens), steps=steps, budget=tokens))
            runs.append(made_up_run("Muon", seed, scale(1.5 * tokens), steps=steps, budget=tokens))
            # A worse lr at each budget: the fit takes each optimizer's best cell.
            runs.append(made_up_run("AdamW", seed, 2 * scale(tokens), lr=1e-2, steps=steps, budget=tokens))
    report = summarize_sweep(runs, last_k=3)
    fit = report["budget_fit"]
    assert report["budgets"] == [20 * 512, 40 * 512, 80 * 512, 160 * 512]
    assert (fit["fit"]["alpha"], fit["fit"]["beta"], fit["fit"]["gamma"]) == pytest.approx((40.0, 0.3, 2.1), rel=1e-5)
    assert [e["speedup"] for e in fit["speedups"]["Muon"]] == pytest.approx([1.5] * 4, rel=1e-5)
    assert [e["speedup"] for e in fit["speedups"]["AdamW"]] == pytest.approx([1.0] * 4, rel=1e-5)
    assert report["best"]["AdamW"]["lr"] == 1e-3 and report["best"]["AdamW"]["settings"] == {"lr": 1e-3}
    md = format_markdown(report)
    assert "L(D) = 40 · D^(−0.3000) + 2.1000" in md
    # Seeds without spread: the bootstrap over seeds has nothing to draw from, and says so instead of an interval.
    assert fit["interval"] is None and not fit["exact"]
    assert "no bootstrap interval: the seeds of AdamW at 10,240 tokens, AdamW at 20,480 tokens" in md
    assert "| AdamW | 1.00× (1 by definition: the baseline against its own fit) |" in md
    # The page draws the fit and D_eff / D, and shows its table.
    png = plot_budgets(report)
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    page = format_html(report, {"main": None, "sensitivity": None, "budgets": png, "overview": None}, "t")
    assert base64.b64encode(png).decode() in page and "D_eff / D at 10,240 tokens" in page
    # Two budgets are too few for a fit; three are fitted exactly, and the page says so.
    two = summarize_sweep([r for r in runs if r.status["budget"] <= 40 * 512], last_k=3)
    assert two["budget_fit"] is None
    three = summarize_sweep([r for r in runs if r.status["budget"] <= 80 * 512], last_k=3)
    assert three["budget_fit"]["exact"] and "pass through its three points" in format_markdown(three)


def test_the_bootstrap_interval_of_a_noisy_fit_covers_the_truth():
    # Five budgets, three seeds each with 0.01 of loss noise around 40 * D^-0.3 + 2.1; a target at 1.5x the tokens.
    import random

    rng = random.Random(1)
    budgets = [1e6, 3e6, 1e7, 3e7, 1e8]
    points = [(d, [40.0 * d**-0.3 + 2.1 + rng.gauss(0, 0.01) for _ in range(3)]) for d in budgets]
    target = (1e7, [40.0 * 1.5e7**-0.3 + 2.1 + rng.gauss(0, 0.01) for _ in range(3)])
    interval = statistics.bootstrap_power_law(points, [target], resamples=200)
    fit = statistics.fit_power_law(budgets, [statistics.mean(losses) for _, losses in points])
    for (low, high), estimate in zip((interval.alpha, interval.beta, interval.gamma), (fit.alpha, fit.beta, fit.gamma)):
        assert low < estimate < high and low < high
    assert interval.gamma[0] < 2.1 < interval.gamma[1]
    estimate = fit.tokens_for(statistics.mean(target[1])) / 1e7
    assert interval.speedups[0][0] < estimate < interval.speedups[0][1]
    # Seeded: the same numbers give the same interval; one seed at a budget gives none.
    assert statistics.bootstrap_power_law(points, [target], resamples=200) == interval
    assert statistics.bootstrap_power_law([(d, losses[:1]) for d, losses in points]) is None


def test_the_bootstrap_interval_holds_at_the_nominal_rate_with_three_seeds():
    # 40 made-up studies (four budgets, three seeds, normal noise 0.02 around 50 D^-0.3 + 2, a target at 3e6 tokens
    # trained on 4e6): the 95% interval of D_eff / D (0.75) must hold it in at least 38. Resampling the seeds
    # themselves held it in far fewer (a mean resampled from three values covers it about 76% of the time).
    rng = np.random.default_rng(3)
    budgets, held, studies = [1e6, 2e6, 4e6, 8e6], 0, 40
    for _ in range(studies):
        points = [(d, list(50.0 * d**-0.3 + 2.0 + rng.normal(0, 0.02, 3))) for d in budgets]
        target = (4e6, list(50.0 * 3e6**-0.3 + 2.0 + rng.normal(0, 0.02, 3)))
        interval = statistics.bootstrap_power_law(points, [target], resamples=100, seed=int(rng.integers(1 << 30)))
        held += interval is not None and interval.speedups[0][0] <= 0.75 <= interval.speedups[0][1]
    assert held >= studies - 2, held


def test_cells_are_keyed_by_every_swept_option():
    runs = [
        made_up_run("AdamW", 0, scale, options={"weight_decay": wd})
        for wd, scale in ((0.0, 1.2), (0.1, 1.0), (0.3, 1.1))
    ] + [made_up_run("AdamW", 0, 1.4, lr=lr, options={"weight_decay": 0.1}) for lr in (1e-2, 2e-5)]
    report = summarize_sweep(runs, last_k=3)
    assert report["best"]["AdamW"]["settings"] == {"lr": 1e-3, "weight_decay": 0.1}
    assert len(report["grid"]) == 5 and swept_hyperparameters(report) == ["lr", "weight_decay"]
    # Cells in numeric order of their settings (2e-5 before 1e-3, though "2e-05" sorts after "0.001" as text).
    assert [(c["lr"], c["settings"]["weight_decay"]) for c in report["grid"]] == [
        (2e-5, 0.1),
        (1e-3, 0.0),
        (1e-3, 0.1),
        (1e-3, 0.3),
        (1e-2, 0.1),
    ]
    header, _ = grid_rows(report)
    assert header[1:3] == ["lr 2e-5, weight_decay 0.1", "lr 1e-3, weight_decay 0.0"]


def test_seeds_varied_names_the_data_seed():
    varied = [made_up_run("AdamW", s, 1.0, data_seed=s) for s in range(2)]
    assert summarize_sweep(varied, 3)["seeds_varied"] == (
        "model initialisation (training.seed) and data order (training.data_seed)"
    )
    fixed = [
        made_up_run("AdamW", s, 1.0, dataset={"fingerprint": "ab", "source": "x", "data_seed": 7}) for s in range(2)
    ]
    assert summarize_sweep(fixed, 3)["seeds_varied"].endswith("data order fixed (data seed 7)")


def test_runs_on_different_data_are_refused_and_unfingerprinted_data_is_said():
    a = {"fingerprint": "aaa", "source": "shards/a", "data_seed": 0}
    b = {"fingerprint": "bbb", "source": "shards/b", "data_seed": 0}
    with pytest.raises(UserError, match=r"read different data \(AdamW_lr1e-3_seed0: dataset fingerprint aaa, "):
        summarize_sweep([made_up_run("AdamW", 0, 1.0, dataset=a), made_up_run("Muon", 0, 1.0, dataset=b)], 3)
    null = {"fingerprint": None, "source": "text", "data_seed": None}
    report = summarize_sweep([made_up_run("AdamW", 0, 1.0, dataset=a), made_up_run("Muon", 0, 1.0, dataset=null)], 3)
    assert report["data"]["fingerprint"] == "aaa" and report["data"]["not_fingerprinted"] == ["Muon_lr1e-3_seed0"]
    assert "Data: fingerprint aaa; 1 runs data not fingerprinted." in format_markdown(report)
    none = summarize_sweep([made_up_run("AdamW", 0, 1.0), made_up_run("Muon", 0, 1.0, dataset=null)], 3)
    assert "data not fingerprinted" in format_markdown(none)


def test_diverged_best_candidates_are_skipped_and_missing_baseline_said():
    runs = [made_up_run("Muon", s, 1.0) for s in range(2)] + [made_up_run("Muon", 0, 0.5, lr=1e-2, outcome="diverged")]
    report = summarize_sweep(runs, last_k=3)
    assert report["best"]["Muon"]["lr"] == 1e-3 and not report["baseline_found"]
    assert "The baseline AdamW is not in this sweep" in format_markdown(report)
    assert report["best"]["Muon"]["speedup"] is None and report["best"]["Muon"]["versus_baseline"] is None


# ----------------------------------------------------------------------------------------------------------------
# Reading runs, the page, and the command line


def write_jsonl_run(run_dir: Path, run: SweepRun, dataset: dict | None = None) -> None:
    """A made-up run on disk as train.py and the sweep leave it: metrics.jsonl, dataset.json, sweep_status.json."""
    log_dir = run_dir / "tb" / "20260101-000000_x"
    log_dir.mkdir(parents=True)
    by_step: dict[int, dict] = {}
    for tag, series in run.scalars.items():
        for step, value in zip(series.steps, series.values):
            by_step.setdefault(step, {})[tag] = value
    (log_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, **m}) + "\n" for s, m in sorted(by_step.items()))
    )
    if dataset is not None:
        (log_dir / "dataset.json").write_text(json.dumps(dataset))
    (run_dir / "sweep_status.json").write_text(json.dumps(run.status))


def test_metrics_jsonl_reads_as_the_event_files_do(tmp_path):
    from torchtitan.telemetry.metrics import MetricLogger

    logger = MetricLogger(str(tmp_path), enable_tensorboard=True)
    for step in range(1, 6):
        logger.log({LOSS: 3.0 / step, "grad_norm": float("nan") if step == 5 else 1.0}, step)
    logger.close()
    from_jsonl = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    from_events = read_scalars(tmp_path)
    # The same steps and values (event files hold float32, metrics.jsonl the logged float itself).
    assert from_jsonl[LOSS].steps == from_events[LOSS].steps
    assert from_jsonl[LOSS].values == pytest.approx(from_events[LOSS].values, rel=1e-6)
    assert from_jsonl["grad_norm"].steps == from_events["grad_norm"].steps
    assert math.isnan(from_jsonl["grad_norm"].values[-1])
    # A line cut short by a crash at the end is left out; the rest reads.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss_metr')
    assert read_metrics_jsonl(tmp_path / "metrics.jsonl")[LOSS].steps == (1, 2, 3, 4, 5)
    assert merged_scalars(tmp_path)[LOSS] == read_metrics_jsonl(tmp_path / "metrics.jsonl")[LOSS]


def test_study_page_is_self_contained_and_rebuilt_by_report_only(tmp_path, capsys):
    dump = tmp_path / "sweep"
    data = {"fingerprint": "f00d", "source": "shards", "data_seed": 0}
    for optimizer, scale in (("AdamW", 1.0), ("AdamMini", 1.05), ("Muon", 0.8)):
        for lr, bump in ((1e-3, 0.0), (3e-3, 0.3)):
            for seed in range(2):
                own = 0.001 * seed * (optimizer != "AdamW")  # a little noise of each run's own
                run = made_up_run(optimizer, seed, scale + bump + 0.01 * seed + own, lr=lr)
                write_jsonl_run(dump / "runs" / run.spec.name, run, data)
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "3"]) == 0
    out = capsys.readouterr().out
    # Every optimizer's best lr is the smallest of two: the table and the verdict say it may lie beyond the grid.
    assert "study.html" in out and "| Muon | lr 1e-3 (at the grid's edge: 1e-3 is the smallest lr tried) |" in out
    edges = "its best lr 1e-3 is the smallest tried; AdamW's (the baseline's) best lr 1e-3 is the smallest tried"
    assert f"at the grid's edge: {edges}: may change with a wider grid" in out
    page = (dump / "study.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4  # main picture, tuning, sensitivity, overview (no budgets: said instead)
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    assert "http" not in page.replace("<!DOCTYPE html>", "") and "<script" not in page  # nothing fetched
    assert "No budget fit: the sweep holds fewer than three token budgets." in page
    assert "Data: every run read dataset fingerprint f00d." in page
    for column in ("optimizer state", "peak memory", "tokens/s per process", "speedup at matched loss"):
        assert column in page
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["Muon"]["versus_baseline"]["verdict"] == "better"
    # --report-only rebuilds the same page from the folder alone.
    (dump / "study.html").unlink()
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "3"]) == 0
    assert (dump / "study.html").read_text() == page
    # Another baseline, and one that is not there.
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "3", "--baseline", "Muon"]) == 0
    assert json.loads((dump / "sweep.json").read_text())["best"]["AdamW"]["versus_baseline"]["verdict"] == "worse"
    capsys.readouterr()
    assert main(["--dump-folder", str(dump), "--report-only", "--baseline", "Lion"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --baseline Lion is not an optimizer of this sweep (AdamMini, AdamW, Muon); name one of them"


def test_report_only_refuses_runs_on_different_data_in_one_line(tmp_path, capsys):
    dump = tmp_path / "sweep"
    for optimizer, fingerprint in (("AdamW", "aaa"), ("Muon", "bbb")):
        run = made_up_run(optimizer, 0, 1.0)
        write_jsonl_run(dump / "runs" / run.spec.name, run, {"fingerprint": fingerprint, "source": "x", "data_seed": 0})
    assert main(["--dump-folder", str(dump), "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "read different data" in err
    assert not (dump / "study.html").exists() and not (dump / "sweep.md").exists()


def test_vary_data_seed_gives_each_run_its_seed_as_data_seed(tmp_path):
    spec = RunSpec("AdamW", 1e-3, 4)
    command = run_command(spec, tmp_path, ["--training.steps", "3"], ["launch"], vary_data_seed=True)
    assert command[command.index("--training.data_seed") + 1] == "4"
    assert "--training.data_seed" not in run_command(spec, tmp_path, [], ["launch"])
    check_train_options(["--training.data_seed", "3"])  # a fixed data seed for every run is fine without the flag
    with pytest.raises(UserError, match="set by the sweep for each run with --vary-data-seed"):
        check_train_options(["--training.data_seed", "3"], vary_data_seed=True)
