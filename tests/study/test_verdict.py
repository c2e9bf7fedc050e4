"""A verdict that cannot mislead: best settings chosen on selection seeds and tested on confirmation seeds, and what
the page says about either.

The rate test simulates many studies of two equal optimizers through the study's statistics (no trainer); the
sweep's part uses tests/sweep_fake_trainer.py, whose loss is lowest at lr 1e-3 and grows by 0.01 per seed number.
"""

from __future__ import annotations

import html
import json

import numpy as np
import pytest

from tests.helpers import fake_sweep, one_error_line
from torchtitan.study import statistics
from torchtitan.tools.sweep import main

# ----------------------------------------------------------------------------------------------------------------
# Selection bias in a made-up world of equal optimizers


def simulated_verdicts(studies: int, settings_a: int, seeds: int, confirm: bool, rng: np.random.Generator) -> dict:
    """How often the verdict says better / worse for optimizer A (``settings_a`` settings) against B (one setting)
    when every setting of both has the same true loss: each run's loss is a seed effect both optimizers share (same
    initial weights and data) plus noise of its own. A's best setting is the lowest mean over the selection seeds;
    the verdict compares it with B on the selection seeds, or with ``confirm`` on fresh seeds."""
    counts = {statistics.BETTER: 0, statistics.WORSE: 0, statistics.NO_DIFFERENCE: 0}
    for _ in range(studies):
        shared = rng.normal(0.0, 0.02, seeds)
        a = shared + rng.normal(0.0, 0.01, (settings_a, seeds))
        b = shared + rng.normal(0.0, 0.01, seeds)
        best = a[np.argmin(a.mean(axis=1))]
        if confirm:  # the chosen setting and B again, on new seeds: new seed effects, new noise
            fresh = rng.normal(0.0, 0.02, seeds)
            best, b = fresh + rng.normal(0.0, 0.01, seeds), fresh + rng.normal(0.0, 0.01, seeds)
        counts[statistics.paired_difference(list(best), list(b)).verdict] += 1
    return {k: v / studies for k, v in counts.items()}


def test_confirmation_seeds_keep_false_verdicts_at_the_nominal_rate():
    # 8 settings against 1, 3 seeds a side, 4,000 studies: with confirmation seeds "better" and "worse" each come at
    # most at the nominal 2.5% (plus three binomial standard errors); choosing and testing on the same seeds says
    # "better" for the optimizer with more settings about three times as often.
    studies, rng = 4000, np.random.default_rng(0)
    slack = 3 * (0.025 * 0.975 / studies) ** 0.5
    confirmed = simulated_verdicts(studies, 8, 3, confirm=True, rng=rng)
    assert confirmed[statistics.BETTER] <= 0.025 + slack and confirmed[statistics.WORSE] <= 0.025 + slack
    shared = simulated_verdicts(studies, 8, 3, confirm=False, rng=rng)
    print(f"false verdicts, 8 settings vs 1, 3 seeds: confirmed {confirmed}, selection seeds reused {shared}")
    assert shared[statistics.BETTER] > 0.05 > 0.025 + slack  # about 7%


# ----------------------------------------------------------------------------------------------------------------
# The sweep: --confirm-seeds

GRID = ("--optimizers", "AdamW,Muon", "--lrs", "1e-4,1e-3,1e-2", "--seeds", "0,1")


def test_confirm_seeds_train_the_best_settings_again_and_the_verdict_reads_only_them(tmp_path, capsys):
    dump = tmp_path / "sweep"
    assert fake_sweep(dump, *GRID, "--confirm-seeds", "2,3") == 0
    names = sorted(p.name for p in (dump / "runs").iterdir())
    confirmations = [n for n in names if n.endswith(("seed2", "seed3"))]
    # Only each optimizer's best lr (1e-3) on the confirmation seeds; every lr on the selection seeds.
    assert confirmations == [f"{o}_lr1e-3_seed{s}" for o in ("AdamW", "Muon") for s in (2, 3)]
    assert len(names) == 2 * 3 * 2 + 4
    report = json.loads((dump / "sweep.json").read_text())
    assert (report["selection_seeds"], report["confirmation_seeds"]) == ([0, 1], [2, 3])
    muon = report["best"]["Muon"]
    assert muon["seeds"] == [2, 3] and muon["selection"]["seeds"] == [0, 1] and muon["settings_tried"] == 3
    assert all(c["seeds"] == [0, 1] for c in report["grid"])  # the grid ranks the selection runs alone
    by_name = {r["name"]: r for r in report["runs"]}
    confirmed = [by_name[f"Muon_lr1e-3_seed{s}"]["rank_loss"] for s in (2, 3)]
    assert muon["loss_mean"] == sum(confirmed) / 2
    assert muon["versus_baseline"]["method"] == "paired"
    page = (dump / "study.html").read_text()
    assert "chosen on selection seeds 0, 1" in page and "confirmation seeds 2, 3" in page
    assert "Settings tried: AdamW 3, Muon 3" in page
    # The same command again trains nothing; --report-only keeps the confirmation and the recorded --last-k.
    assert fake_sweep(dump, *GRID, "--confirm-seeds", "2,3") == 0
    assert sorted(p.name for p in (dump / "runs").iterdir()) == names
    capsys.readouterr()
    assert main(["--dump-folder", str(dump), "--report-only"]) == 0
    again = json.loads((dump / "sweep.json").read_text())
    assert again["last_k"] == 3 and again["best"]["Muon"]["seeds"] == [2, 3]
    # A later call that leaves --confirm-seeds out keeps the study confirmed (it does not judge on seeds 0-3).
    assert fake_sweep(dump, *GRID) == 0
    assert sorted(p.name for p in (dump / "runs").iterdir()) == names
    later = json.loads((dump / "sweep.json").read_text())
    assert later["confirmation_seeds"] == [2, 3] and later["best"]["Muon"]["seeds"] == [2, 3]
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", "--seeds", "2") == 2  # a recorded one
    assert "the confirmation seeds this study recorded 2 also in --seeds" in one_error_line(capsys)


def test_an_optimizer_added_in_a_later_call_leaves_the_earlier_ones_ranked(tmp_path):
    dump = tmp_path / "sweep"
    axis = ("--axis", "optimizer.weight_decay=0.1,0.3")
    assert fake_sweep(dump, "--optimizers", "AdamW,Muon", "--lrs", "1e-3", *axis) == 0
    assert fake_sweep(dump, "--optimizers", "NorMuon", "--lrs", "1e-3", *axis) == 0
    report = json.loads((dump / "sweep.json").read_text())
    assert set(report["best"]) == {"AdamW", "Muon", "NorMuon"} and report["older_runs"] == []
    assert report["best"]["AdamW"]["settings"] == {"lr": 1e-3, "optimizer.weight_decay": 0.1}


def test_without_confirmation_the_page_says_the_seeds_were_shared(tmp_path):
    dump = tmp_path / "sweep"
    assert fake_sweep(dump, "--optimizers", "AdamW,Muon", "--lrs", "1e-3,1e-2", "--seeds", "0,1") == 0
    page = (dump / "study.html").read_text()
    assert "chosen and tested on the same seeds (0, 1)" in page
    assert "favours the optimizer that tried more settings" in page


def test_confirmation_seeds_must_differ_from_the_selection_seeds(tmp_path, capsys):
    assert fake_sweep(tmp_path / "s", *GRID, "--confirm-seeds", "1,2") == 2
    assert "--confirm-seeds 1 also in --seeds" in one_error_line(capsys)
    assert not (tmp_path / "s" / "runs").exists()


# ----------------------------------------------------------------------------------------------------------------
# Smaller findings: long lr labels, strict JSON, encoded links, tokens/s after compilation


def test_lrs_with_many_digits_each_train_under_their_own_exact_name(tmp_path):
    # Two lrs that agree in their first 15 significant digits: each a run of its own, named by its exact value.
    lrs = ("1.000000000000001e-3", "1.000000000000002e-3", "3e-3")
    dump = tmp_path / "sweep"
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", ",".join(lrs), "--search", "coordinate") == 0
    names = sorted(p.name for p in (dump / "runs").iterdir())
    assert names == [f"AdamW_lr{lr}_seed0" for lr in lrs]
    recorded = [json.loads((dump / "runs" / n / "sweep_status.json").read_text())["lr"] for n in names]
    assert recorded == [float(lr) for lr in lrs]


def test_reports_are_strict_json_with_a_reason_for_each_missing_number(tmp_path):
    # A diverged point of a descent scores infinity: sweep.json says null and why, and a strict parser reads it.
    dump = tmp_path / "sweep"
    args = ("--optimizers", "AdamW", "--lrs", "1e-4,1e-3,1e-2", "--search", "coordinate")
    args += ("--start", "optimizer.lr=1e-2")
    assert fake_sweep(dump, *args, outcomes={"AdamW_lr1e-2_seed0": "nan"}) == 0

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    for name in ("sweep.json", "search.json", "sweep_settings.json", "runs/AdamW_lr1e-2_seed0/sweep_status.json"):
        json.loads((dump / name).read_text(), parse_constant=refuse)
    text = (dump / "sweep.json").read_text()
    assert '"loss": null' in text and '"loss_reason": "infinite"' in text


def test_links_on_the_page_are_percent_encoded():
    from torchtitan.study.report import _html_table, _md_cell

    page = _html_table(["run"], [[("odd", "runs/AdamW_lr1e-3_seed0_tagA#50%/train.log")]])
    assert 'href="runs/AdamW_lr1e-3_seed0_tagA%2350%25/train.log"' in page
    assert _md_cell(("odd", "runs/x #1/")) == "[odd](runs/x%20%231/)"


def test_tokens_per_second_leaves_out_the_compile_warm_up():
    from torchtitan.study.run_folders import TPS, Series
    from torchtitan.study.summary import summarize

    # The first two logged values cover compilation (half speed); the rest is the steady throughput.
    scalars = {TPS: Series((1, 2, 3, 4, 5), (500.0, 900.0, 1000.0, 1000.0, 1000.0))}
    assert summarize(scalars, last_k=3)["mean_tps"] == 1000.0
    assert summarize({TPS: Series((1,), (500.0,))}, last_k=3)["mean_tps"] == 500.0  # nothing after: the last one


# ----------------------------------------------------------------------------------------------------------------
# An axis added to a sweep


def run_names(dump) -> list[str]:
    return sorted(p.name for p in (dump / "runs").iterdir())


def test_an_added_axis_continues_the_descent_from_the_runs_already_there(tmp_path):
    # The job's weight decay is 0.1 (debug_model.toml), one of the new axis's values: the first descent's runs are
    # its weight-decay-0.1 points, so the descent along lr is not trained again, only the new setting's neighbours.
    dump = tmp_path / "sweep"
    lrs = ("--optimizers", "AdamW", "--lrs", "1e-4,1e-3,1e-2", "--search", "coordinate")
    assert fake_sweep(dump, *lrs) == 0
    first = run_names(dump)
    assert first == ["AdamW_lr1e-2_seed0", "AdamW_lr1e-3_seed0", "AdamW_lr1e-4_seed0"]
    assert fake_sweep(dump, *lrs, "--axis", "optimizer.weight_decay=0.0,0.1,0.3") == 0
    added = sorted(set(run_names(dump)) - set(first))
    assert added == ["AdamW_lr1e-3_seed0_optimizer.weight_decay0.0", "AdamW_lr1e-3_seed0_optimizer.weight_decay0.3"]
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["AdamW"]["settings"] == {"lr": 1e-3, "optimizer.weight_decay": 0.1}
    assert report["descents"][0]["state"] == "converged" and report["older_runs"] == []


def test_the_ranking_reads_only_cells_of_the_current_axes(tmp_path):
    # A weight-decay axis without the job's own value (0.1): the earlier runs fit none of its settings, so they are
    # listed apart, not ranked, and the grid trains every new cell.
    dump = tmp_path / "sweep"
    grid = ("--optimizers", "AdamW", "--lrs", "1e-3,1e-2")
    assert fake_sweep(dump, *grid) == 0
    assert fake_sweep(dump, *grid, "--axis", "optimizer.weight_decay=0.0,0.3") == 0
    report = json.loads((dump / "sweep.json").read_text())
    assert sorted(report["older_runs"]) == ["AdamW_lr1e-2_seed0", "AdamW_lr1e-3_seed0"]
    assert all("optimizer.weight_decay" in c["settings"] for c in report["grid"]) and len(report["grid"]) == 4
    assert "Not ranked: 2 runs of earlier axes" in (dump / "study.html").read_text()
    # With the job's value among the axis's, those runs are its cells: nothing of theirs trains twice.
    before = run_names(dump)
    assert fake_sweep(dump, *grid, "--axis", "optimizer.weight_decay=0.0,0.1,0.3") == 0
    assert run_names(dump) == before
    report = json.loads((dump / "sweep.json").read_text())
    assert report["older_runs"] == [] and len(report["grid"]) == 6


# ----------------------------------------------------------------------------------------------------------------
# Past the grid's ends


def test_extend_steps_a_descent_past_the_grids_end_until_the_optimum_is_inside(tmp_path):
    # The fake trainer's loss is lowest at lr 1e-3; the grid 1e-5, 1e-4 stops at its end. --extend goes on by the
    # grid's ratio (x10): 1e-3 is better, 1e-2 worse, so the optimum is inside after two extensions of three.
    dump = tmp_path / "sweep"
    args = ("--optimizers", "AdamW", "--lrs", "1e-5,1e-4", "--search", "coordinate")
    assert fake_sweep(dump, *args, "--extend", "3") == 0
    assert run_names(dump) == [f"AdamW_lr{lr}_seed0" for lr in ("1e-2", "1e-3", "1e-4", "1e-5")]
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["AdamW"]["settings"] == {"lr": 1e-3} and report["best"]["AdamW"]["edges"] == []
    assert json.loads((dump / "search.json").read_text())["extended"] == {"AdamW": 2}
    # With one extension only, the descent stops at 1e-3, the end of the grown grid: the page says so.
    small = tmp_path / "small"
    assert fake_sweep(small, *args, "--extend", "1") == 0
    assert run_names(small) == [f"AdamW_lr{lr}_seed0" for lr in ("1e-3", "1e-4", "1e-5")]
    assert "at the grid's edge: 1e-3 is the largest lr tried" in html.unescape((small / "study.html").read_text())


def test_extended_values_follow_the_grids_ratio_or_step_and_never_cross_zero():
    from torchtitan.study.search import Coordinate, extended_value

    assert extended_value(Coordinate("lr", ("1e-3", "3e-3")), 1) == "9e-3"
    assert extended_value(Coordinate("lr", ("1e-3", "3e-3")), -1) == "3.33333333333e-4"
    assert extended_value(Coordinate("optimizer.weight_decay", ("0.0", "0.1", "0.3")), 1) == "5e-1"
    assert extended_value(Coordinate("optimizer.weight_decay", ("0.0", "0.1")), -1) is None  # below zero
    assert extended_value(Coordinate("training.steps", ("2", "4")), 1) == "8"
    assert extended_value(Coordinate("model.norm", ("rms", "layer")), 1) is None  # words have no next value


def test_extend_needs_a_descent(tmp_path, capsys):
    assert fake_sweep(tmp_path / "s", "--optimizers", "AdamW", "--lrs", "1e-3,1e-2", "--extend", "2") == 2
    assert "--extend steps a coordinate descent" in one_error_line(capsys)


def test_a_descent_on_one_seed_confirmed_on_three(tmp_path):
    dump = tmp_path / "sweep"
    args = ("--optimizers", "AdamW,Muon", "--lrs", "1e-4,1e-3,1e-2", "--search", "coordinate", "--seeds", "0")
    assert fake_sweep(dump, *args, "--confirm-seeds", "1,2,3") == 0
    report = json.loads((dump / "sweep.json").read_text())
    for optimizer in ("AdamW", "Muon"):
        b = report["best"][optimizer]
        assert b["settings"] == {"lr": 1e-3} and b["seeds"] == [1, 2, 3] and b["selection"]["seeds"] == [0]
    # One selection seed, three confirmation seeds: a verdict with an interval, not "one seed".
    assert report["best"]["Muon"]["versus_baseline"]["method"] == "paired"
    assert "One seed per cell" not in (dump / "sweep.md").read_text()


def test_a_verdict_waits_for_its_confirmation_runs(tmp_path):
    # The selection ran, the confirmation runs have not: the row says so instead of a verdict on other seeds.
    from tests.study.test_study import made_up_run
    from torchtitan.study.report import format_markdown
    from torchtitan.study.summary import summarize_sweep

    runs = [made_up_run(o, seed, scale) for o, scale in (("AdamW", 1.0), ("Muon", 0.5)) for seed in (0, 1)]
    report = summarize_sweep(runs, last_k=3, confirm_seeds=[2, 3])
    assert report["best"]["Muon"]["versus_baseline"] is None and report["best"]["Muon"]["loss_mean"] is None
    row = next(line for line in format_markdown(report).splitlines() if line.startswith("| Muon |"))
    assert "not confirmed yet" in row and "better" not in row


@pytest.mark.parametrize(
    "confirmation, state, words",
    [
        ((("Muon", 2, "finished"),), "pending", "not confirmed yet"),  # seed 3 has not ended
        ((("Muon", 2, "finished"), ("Muon", 3, "diverged")), "diverged", "diverged on a confirmation seed"),
        ((("Muon", 2, "finished"), ("Muon", 3, "failed")), "failed", "a confirmation run failed"),
    ],
    ids=["one-of-two-ended", "one-diverged", "one-failed"],
)
def test_a_verdict_reads_every_confirmation_seed_or_none(confirmation, state, words):
    # Muon is better on every seed that finished (each seed scales both losses by 1 + 0.01 seed); a verdict from the
    # survivors alone would say "better".
    from tests.study.test_study import made_up_run
    from torchtitan.study.report import format_markdown
    from torchtitan.study.summary import summarize_sweep

    runs = [
        made_up_run(o, seed, scale * (1 + 0.01 * seed))
        for o, scale in (("AdamW", 1.0), ("Muon", 0.5))
        for seed in (0, 1, 2, 3)
    ]
    runs = [r for r in runs if not (r.spec.optimizer == "Muon" and r.spec.seed in (2, 3))]
    runs += [made_up_run(o, seed, 0.5 * (1 + 0.01 * seed), outcome=outcome) for o, seed, outcome in confirmation]
    report = summarize_sweep(runs, last_k=3, confirm_seeds=[2, 3])
    muon = report["best"]["Muon"]
    assert muon["confirmation"] == state and report["best"]["AdamW"]["confirmation"] == "finished"
    assert muon["loss_mean"] is None and muon["versus_baseline"] is None and muon["speedup"] is None
    row = next(line for line in format_markdown(report).splitlines() if line.startswith("| Muon |"))
    assert words in row and "better" not in row
    # Every seed finished: the verdict.
    runs = [r for r in runs if not (r.spec.optimizer == "Muon" and r.spec.seed in (2, 3))]
    runs += [made_up_run("Muon", seed, 0.5 * (1 + 0.01 * seed)) for seed in (2, 3)]
    done = summarize_sweep(runs, last_k=3, confirm_seeds=[2, 3])["best"]["Muon"]
    assert done["confirmation"] == "finished" and done["versus_baseline"]["verdict"] == "better"


def test_a_value_extend_would_add_is_checked_before_it_trains(tmp_path, capsys):
    # beta2 is at the grid's end (0.95, 0.99; the fake loss ignores it, so the descent stays at its start 0.99):
    # the next value by the grid's ratio, 1.03, is no beta. It is refused before any run, and the descent ends.
    dump = tmp_path / "sweep"
    args = ("--optimizers", "AdamW", "--lrs", "1e-4,1e-3,1e-2", "--axis", "optimizer.beta2=0.95,0.99")
    args += ("--search", "coordinate", "--start", "optimizer.beta2=0.99")
    assert fake_sweep(dump, *args, "--extend", "2") == 0
    out = capsys.readouterr().out
    assert "AdamW: best optimizer.beta2 at the grid's end; not extended to 1.03168421053e0: " in out, out
    assert "optimizer.beta2 must be in [0, 1)" in out
    assert not any("beta2=1.03" in name for name in run_names(dump))
    space = json.loads((dump / "search.json").read_text())["spaces"]["AdamW"]
    assert ["0.95", "0.99"] in [c["values"] for c in space["coordinates"]], space
