"""A study across model sizes: the laws fitted across sizes recover a known law in made-up studies (pure functions,
seconds), the carried-up lr grid holds the true best lr, and a study over sizes runs end to end on the fake trainer
(each size its own search and confirmation, a size added later carried up onto the same page)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import fake_sweep, one_error_line
from torchtitan.study.plan import lr_label
from torchtitan.study.scale import (
    TrendPoint,
    carried_grid,
    fit_log_line,
    fit_trend,
    predicted_against_found,
)
from torchtitan.study.statistics import combine_speedups

# The ladder's non-embedding parameters (docs/study-runs.md), as the made-up studies' sizes.
PARAMS = {
    "ladder-30M": 30_157_312,
    "ladder-60M": 62_930_688,
    "ladder-130M": 125_860_608,
    "ladder-300M": 293_131_264,
    "ladder-520M": 503_379_456,
    "ladder-1.2B": 1_179_752_448,
}
REFERENCE, TARGET = 3e7, 8e9


def made_up_speedups(rng, s0: float, exponent: float, seeds: int, noise: float) -> list[TrendPoint]:
    """Each size's speedup as a study measures it: per seed, the true speedup s0 (N / N0)^exponent off by a factor
    exp(noise Z); over seeds, the geometric mean and its t interval (``combine_speedups``, as the report does)."""
    points = []
    for n in PARAMS.values():
        true = s0 * (n / REFERENCE) ** exponent
        s = combine_speedups([(true * math.exp(rng.normal(0.0, noise)), None) for _ in range(seeds)])
        points.append(TrendPoint(n, s.value, s.low, s.high, seeds - 1))
    return points


def test_the_speedup_trend_recovers_a_known_exponent_and_its_value_at_8b_in_at_least_90_of_100_studies():
    rng = np.random.default_rng(0)
    s0, exponent = 1.4, -0.1  # 1.4x at 30M falling as N^-0.1 (about 1.05x at 1.2B)
    covered = at_target = 0
    for _ in range(100):
        trend = fit_trend(made_up_speedups(rng, s0, exponent, seeds=3, noise=0.05), TARGET)
        low, high = trend.exponent_interval
        covered += low <= exponent <= high
        low, high = trend.target_interval
        at_target += low <= s0 * (TARGET / REFERENCE) ** exponent <= high
    assert covered >= 90 and at_target >= 90, (covered, at_target)


def test_sizes_off_one_power_law_widen_the_trend_and_two_sizes_leave_it_underdetermined():
    # Tight per-size intervals around a bent curve: the F test finds the excess scatter and widens the interval.
    bent = [TrendPoint(n, 1.3 - 0.1 * (math.log(n / REFERENCE) - 1.8) ** 2, 0, 0, 4) for n in PARAMS.values()]
    bent = [TrendPoint(p.params, p.value, p.value * 0.99, p.value / 0.99, 4) for p in bent]
    trend = fit_trend(bent, TARGET)
    assert trend.widened > 3 and "widened" in trend.note
    two = fit_trend(bent[:2], TARGET)
    assert two.exponent_interval is None and two.target_interval is None and two.at_target is not None
    assert two.note.startswith("underdetermined")
    assert fit_log_line([1e7, 2e7], [1e-3, 5e-4]).prediction_interval(4e7) is None


def made_up_lr_study(rng, lr0: float, exponent: float, noise: float) -> tuple[list[float], list[list[float]]]:
    """A study whose sizes each search an lr grid (the first two sizes --lrs, the others --lrs moved to centre on
    the law of the smaller sizes' best lrs) on a loss that is a parabola in log lr about lr0 (N / N0)^exponent plus
    noise: the best lr found per size and the grid each size searched."""
    truth = [lr0 * (n / REFERENCE) ** exponent for n in PARAMS.values()]
    centre = truth[0] * math.exp(rng.uniform(-0.5, 0.5))  # the user's grid is centred near, not on, the best lr
    lrs = [centre / 4, centre / 2, centre, centre * 2, centre * 4]
    params, found, grids = list(PARAMS.values()), [], []
    for i, n in enumerate(params):
        grid = lrs if i < 2 else carried_grid(lrs, fit_log_line(params[:i], found).at(n))
        losses = [0.5 * (math.log(lr) - math.log(truth[i])) ** 2 + rng.normal(0.0, noise) for lr in grid]
        found.append(grid[int(np.argmin(losses))])
        grids.append(grid)
    return found, grids


def test_the_best_lr_law_recovers_a_known_exponent_and_the_carried_grid_holds_the_true_best_lr():
    rng = np.random.default_rng(1)
    lr0, exponent = 3e-3, -0.35
    covered = 0
    for _ in range(100):
        found, grids = made_up_lr_study(rng, lr0, exponent, noise=0.02)
        low, high = fit_log_line(list(PARAMS.values()), found).exponent_interval()
        covered += low <= exponent <= high
        for n, grid in list(zip(PARAMS.values(), grids))[2:]:
            assert min(grid) <= lr0 * (n / REFERENCE) ** exponent <= max(grid)
    assert covered >= 90, covered
    # Predicted against found for every size after the first two; an interval once three smaller sizes are known.
    rows = predicted_against_found([(name, n, lr) for (name, n), lr in zip(PARAMS.items(), found)])
    assert [r["size"] for r in rows] == list(PARAMS)[2:]
    assert rows[0]["interval"] is None and rows[0]["predicted"] is not None
    assert all(r["interval"] is not None and r["inside"] is not None for r in rows[1:])


def test_a_carried_grid_keeps_the_ratios_of_lrs_and_centres_on_the_prediction():
    grid = carried_grid([2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3], 3e-4)
    assert grid == [7.5e-05, 0.00015, 0.0003, 0.0006, 0.0012]
    assert carried_grid([1e-3, 3e-3], 1e-3) == [0.000577, 0.00173]


# ----------------------------------------------------------------------------------------------------------------
# End to end on the fake trainer

LAW = {
    "params": PARAMS,
    "reference": REFERENCE,
    "lr": 1e-3,
    "lr_exponent": -0.5,
    "speedup": 0.8,  # AdamMini slower than AdamW, so that each size's speedup at matched loss is a value
    "speedup_exponent": -0.1,
    "noise": 0.05,
    "baseline": "AdamW",
}


def ladder_sweep(dump: Path, *args: str) -> int:
    return fake_sweep(
        dump,
        "--optimizers",
        "AdamW,AdamMini",
        "--lrs",
        "5e-4,1e-3,2e-3",
        "--confirm-seeds",
        "1,2",
        "--carry-lrs",
        "--target-params",
        "8e9",
        "--parallel",
        "2",
        *args,
        "--",
        "--training.steps",
        "30",
        FAKE_SCALE=json.dumps(LAW),
    )


def test_a_study_over_sizes_carries_the_lr_up_and_a_size_added_later_joins_the_same_page(tmp_path, capsys):
    """The ladder as a user grows it, in two calls of the sweep over fake runs: per-size pages and confirmations, an
    lr grid carried up to a size added later without retraining the others, the scale view, a plain sweep refused in
    the study's folder, and --report-only rebuilding the same view."""
    dump = tmp_path / "study"
    sizes = ["--axis", "model.flavor=ladder-30M,ladder-60M", "--size-option", "ladder-60M:training.batch_size=4"]
    assert ladder_sweep(dump, *sizes) == 0
    for flavor in ("ladder-30M", "ladder-60M"):
        folder = dump / "sizes" / flavor
        assert (folder / "study.html").exists()
        confirmed = sorted(p.name for p in (folder / "runs").glob("*_seed[12]"))
        assert len(confirmed) == 4, confirmed  # each size confirmed its own best settings on seeds 1 and 2
        command = (folder / "runs" / confirmed[0] / "command.sh").read_text()
        assert f"--model.flavor {flavor}" in command
        assert ("--training.batch_size 4" in command) == (flavor == "ladder-60M")
    md = (dump / "sweep.md").read_text()
    assert "at 8B parameters" in md and "underdetermined" in md  # two sizes: a line, no interval

    # A size added in a later call: its lr grid carried up from the two below it, on the same page.
    before = {p: p.read_text() for p in (dump / "sizes").rglob("sweep_status.json")}
    assert ladder_sweep(dump, "--ladder", "ladder-130M") == 0
    assert {p: p.read_text() for p in before} == before  # the smaller sizes trained nothing again
    carried = json.loads((dump / "ladder.json").read_text())["grids"]["ladder-130M"]["AdamW"]
    true_lr = LAW["lr"] * (PARAMS["ladder-130M"] / REFERENCE) ** LAW["lr_exponent"]
    assert min(carried["lrs"]) <= true_lr <= max(carried["lrs"])
    assert math.isclose(math.exp(np.mean(np.log(carried["lrs"]))), carried["predicted"], rel_tol=0.01)
    trained = {p.name.split("_")[1] for p in (dump / "sizes" / "ladder-130M" / "runs").iterdir()}
    assert trained == {f"lr{lr_label(lr)}" for lr in carried["lrs"]}
    view = json.loads((dump / "scale.json").read_text())
    assert [s["size"] for s in view["sizes"]] == ["ladder-30M", "ladder-60M", "ladder-130M"]
    trend = view["optimizers"]["AdamMini"]["speedup_trend"]["fit"]
    low, high = trend["exponent_interval"]
    assert trend["sizes"] == 3 and low <= LAW["speedup_exponent"] <= high and trend["target_interval"] is not None
    law = next(x for x in view["optimizers"]["AdamW"]["laws"] if x["setting"] == "lr")
    assert [(p["size"], p["from_sizes"], p["found"] in carried["lrs"]) for p in law["predicted_vs_found"]] == [
        ("ladder-130M", 2, True)
    ]
    page = (dump / "study.html").read_text()
    assert "sizes/ladder-130M/study.html" in page and "centred on" in page

    capsys.readouterr()
    assert fake_sweep(dump, "--lrs", "1e-3") == 2  # a plain sweep into the study's folder: refused, nothing trained
    assert "holds a study over sizes" in one_error_line(capsys)
    # --report-only rebuilds the same view from disk.
    assert fake_sweep(dump, "--report-only") == 0
    assert json.loads((dump / "scale.json").read_text()) == view


def test_budgets_are_multiples_of_20_tokens_per_parameter_of_each_size_with_its_own_process_count(tmp_path):
    dump = tmp_path / "study"
    ladder = ["--ladder", "ladder-30M,ladder-60M", "--size-nproc", "ladder-60M=2", "--budgets", "1e-5x"]
    train = ["--", "--training.batch_size", "1", "--training.seq_len", "64"]
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", *ladder, *train) == 0
    for (flavor, n), nproc in zip(list(PARAMS.items())[:2], (1, 2)):
        (run,) = (dump / "sizes" / flavor / "runs").iterdir()
        status = json.loads((run / "sweep_status.json").read_text())
        # Each size's 1e-5x is of its own parameters; two processes a run read twice the tokens a step.
        assert status["budget"] == round(1e-5 * 20 * n) and status["steps"] == status["budget"] // (64 * nproc)
        assert f"NGPU={nproc}" in (run / "command.sh").read_text()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--carry-lrs"], "--carry-lrs applies to a study over sizes"),
        (["--ladder", "ladder-30M,ladder-7M"], "'ladder-7M' is not a model flavor"),
        (["--ladder", "ladder-30M", "--axis", "model.flavor=ladder-60M"], "the sizes are given twice"),
        (["--axis", "AdamW:model.flavor=ladder-30M"], "model size is an axis of every optimizer's runs"),
        (["--ladder", "ladder-30M", "--size-nproc", "ladder-60M=2"], "ladder-60M is not among the sizes"),
        (["--ladder", "ladder-30M", "--", "--model.flavor", "ladder-60M"], "set by the study for each size"),
        (["--ladder", "ladder-30M", "--target-params", "0"], "--target-params must be a finite positive number"),
        (["--ladder", "ladder-30M", "--target-params", "inf"], "--target-params must be a finite positive number"),
        (
            ["--ladder", "ladder-30M,ladder-60M", "--size-option", "ladder-60M:training.batchsize=4"],
            "size ladder-60M: unknown config key 'training.batchsize'",
        ),
    ],
)
def test_mistakes_in_a_study_over_sizes_stop_it_in_one_line_before_any_run(tmp_path, capsys, args, says):
    dump = tmp_path / "study"
    assert fake_sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", *args) == 2
    assert says in one_error_line(capsys)
    assert not (dump / "sizes").exists()


def made_up_report(n: int, lr: float, speedup: tuple, d_eff: dict) -> dict:
    """The parts of one size's report (``summary.summarize_sweep``) the scale view reads: AdamMini against AdamW at
    one lr, its speedup at matched loss (value, low, high over three seeds) and D_eff / D per budget multiple."""
    budgets = [round(m * 20 * n) for m in d_eff]

    def best(optimizer: str) -> dict:
        value, low, high = speedup if optimizer == "AdamMini" else (1.0, None, None)
        return {
            "settings": {"lr": lr},
            "edges": [],
            "loss_mean": 3.0,
            "loss_ci": 0.01,
            "seeds": [1, 2, 3],
            "versus_baseline": None
            if optimizer == "AdamW"
            else {"difference": -0.01, "low": -0.02, "high": 0.0, "verdict": "no detectable difference"},
            "speedup": {"value": value, "bound": None, "low": low, "high": high, "seeds": 3},
        }

    best_by_budget = [{"budget": b, "best": {"AdamW": best("AdamW"), "AdamMini": best("AdamMini")}} for b in budgets]
    speedups = {
        "AdamMini": [
            {"budget": b, "speedup": v, "interval": [v * 0.9, v / 0.9], "below_floor": False}
            for b, v in zip(budgets, d_eff.values())
        ]
    }
    return {
        "best": best_by_budget[-1]["best"],
        "best_by_budget": best_by_budget,
        "budgets": budgets,
        "selection_seeds": [0],
        "confirmation_seeds": [1, 2, 3],
        "budget_fit": {"speedups": speedups},
    }


def test_the_scale_view_fits_d_eff_per_budget_multiple_and_says_two_sizes_are_underdetermined(tmp_path):
    from torchtitan.study.scale_report import summarize_scale, write_scale_report

    sizes = [
        {
            "size": name,
            "params": n,
            "folder": f"sizes/{name}",
            "report": made_up_report(n, 1e-3 * (n / REFERENCE) ** -0.5, (s, s * 0.95, s / 0.95), {1: s, 2: s * 0.9}),
        }
        for (name, n), s in zip(list(PARAMS.items())[:3], (1.4, 1.3, 1.2))
    ]
    view = summarize_scale(sizes, {}, "AdamW", TARGET)
    trends = view["optimizers"]["AdamMini"]["d_eff_trends"]
    assert list(trends) == ["1x", "2x"] and all(t["fit"]["sizes"] == 3 for t in trends.values())
    exponent = math.log(1.2 / 1.4) / math.log(PARAMS["ladder-130M"] / PARAMS["ladder-30M"])
    assert trends["1x"]["fit"]["exponent"] == pytest.approx(exponent, abs=0.02)
    low, high = trends["1x"]["fit"]["exponent_interval"]
    assert low < trends["1x"]["fit"]["exponent"] < high
    (law,) = [x for x in view["optimizers"]["AdamMini"]["laws"] if x["budget"] == "1x"]
    assert law["exponent"] == pytest.approx(-0.5) and law["predicted_vs_found"][0]["size"] == "ladder-130M"

    write_scale_report(tmp_path, sizes[:2], {}, "AdamW", TARGET)  # two sizes: a line, no interval
    md = (tmp_path / "sweep.md").read_text()
    assert "at 8B parameters" in md and "underdetermined: two sizes fix a line but cannot bound it" in md
    assert "D_eff / D at 2x" in md and (tmp_path / "study.html").exists()


def test_a_size_that_trained_on_lrs_keeps_them_when_a_smaller_size_joins_below_it(tmp_path):
    # run_ladder with a stand-in for each size's sweep (it records what it was asked and makes the size's folder):
    # the order of sizes, each one's options, and which get a carried grid, without training anything.
    from torchtitan.errors import UserError
    from torchtitan.study.ladder import ladder_flavors, run_ladder
    from torchtitan.tools.sweep import _parser

    asked = []

    def size_sweep(args, train_args) -> int:
        asked.append((Path(args.dump_folder).name, getattr(args, "carried_lrs", None), args.nproc, args.parallel))
        (Path(args.dump_folder) / "runs").mkdir(parents=True, exist_ok=True)
        return 0

    def call(*argv: str) -> None:
        args = _parser().parse_args(["--dump-folder", str(tmp_path), "--lrs", "1e-3,2e-3", "--parallel", "4", *argv])
        with pytest.raises(UserError, match="no run .* has ended yet"):  # the stand-in trained nothing
            run_ladder(args, [], size_sweep, ladder_flavors(args))

    call("--ladder", "ladder-130M,ladder-60M,ladder-300M", "--nproc", "1", "--size-nproc", "ladder-300M=2")
    assert asked == [("ladder-60M", None, 1, 4), ("ladder-130M", None, 1, 4), ("ladder-300M", None, 2, 2)]
    asked.clear()
    call("--ladder", "ladder-30M,ladder-130M", "--carry-lrs")  # 130M is now the third size, and trained on --lrs
    assert asked == [("ladder-30M", None, None, 4), ("ladder-130M", None, None, 4)]
    record = json.loads((tmp_path / "ladder.json").read_text())
    assert list(record["sizes"]) == ["ladder-30M", "ladder-60M", "ladder-130M", "ladder-300M"]
    assert record["grids"] == {} and record["carry_lrs"] is True


def test_an_optimizer_that_diverged_at_every_lr_of_a_size_stops_the_carried_sizes_in_one_line(tmp_path, monkeypatch):
    # AdamMini diverged at both lrs of the two smaller sizes: no best lr will ever come of them, so the third size
    # stops the study with a line naming it (it waited, exit 0, on every call before).
    from tests.study.test_study import made_up_run
    from torchtitan.errors import UserError
    from torchtitan.study import ladder
    from torchtitan.study.summary import summarize_sweep
    from torchtitan.tools.sweep import _parser

    lrs = (1e-3, 2e-3)
    runs = [made_up_run("AdamW", 0, 1.0 + lr, lr=lr) for lr in lrs]
    runs += [made_up_run("AdamMini", 0, 1.0, lr=lr, outcome="diverged") for lr in lrs]
    report = summarize_sweep(runs, last_k=3)

    def size_reports(dump, args, baseline, written=()):
        sizes = ladder.read_ladder(dump)["sizes"].items()
        return [
            {"size": f, "params": n, "folder": f, "report": report}
            for f, n in sizes
            if ladder.size_folder(dump, f).exists()
        ]

    trained = []

    def size_sweep(args, train_args) -> int:
        trained.append(Path(args.dump_folder).name)
        Path(args.dump_folder).mkdir(parents=True)
        return 0

    monkeypatch.setattr(ladder, "size_reports", size_reports)
    argv = ["--dump-folder", str(tmp_path), "--optimizers", "AdamW,AdamMini", "--lrs", "1e-3,2e-3", "--carry-lrs"]
    args = _parser().parse_args([*argv, "--ladder", "ladder-30M,ladder-60M,ladder-130M"])
    says = "--carry-lrs: AdamMini diverged at every lr of ladder-30M, so there is no best lr to carry up to ladder-130M"
    with pytest.raises(UserError, match=re.escape(says)):
        ladder.run_ladder(args, [], size_sweep, ladder.ladder_flavors(args))
    assert trained == ["ladder-30M", "ladder-60M"]


def test_token_budgets_are_the_same_budget_at_every_size_and_the_target_is_placed_against_the_sizes():
    # --budgets given in tokens: every size trained the same three token counts, so the scale view has three D_eff
    # columns (read as multiples of each size's parameters they were six, mostly "not run").
    from tests.study.test_study import TOKENS_PER_STEP, made_up_run
    from torchtitan.study.plan import tokens_label
    from torchtitan.study.scale_report import format_scale_markdown, summarize_scale
    from torchtitan.study.summary import summarize_sweep

    runs = []
    for steps in (20, 40, 80):
        tokens = steps * TOKENS_PER_STEP
        for optimizer, scale in (("AdamW", 1.0), ("AdamMini", 0.9)):
            for seed in range(2):
                loss = scale * (40.0 * tokens**-0.3 + 0.1) * steps / 8.0 * (1 + 0.01 * seed + 0.001 * seed * scale)
                run = made_up_run(optimizer, seed, loss, steps=steps, budget=tokens)
                run.status["budget_label"] = tokens_label(tokens)
                runs.append(run)
    report = summarize_sweep(runs, last_k=3)
    sizes = [{"size": f, "params": n, "folder": f, "report": report} for f, n in list(PARAMS.items())[:2]]
    for target, place in (
        (1e7, "below the smallest size trained (30.2M): each value at it extrapolates downward"),
        (4e7, "within the sizes trained (30.2M to 62.9M): values at it interpolate"),
        (8e9, "127× past the largest size trained (62.9M): a value at it assumes each law holds that far"),
    ):
        view = summarize_scale(sizes, {}, "AdamW", target)
        assert list(view["optimizers"]["AdamMini"]["d_eff_trends"]) == [tokens_label(t) for t in report["budgets"]]
        assert place in format_scale_markdown(view)


def test_the_best_lr_law_counts_the_grid_step_and_its_exponent_interval_holds_the_truth():
    # 400 made-up laws a setting: each size's best lr is the true lr0 (N / N0)^-0.3, off by exp(0.05 Z), rounded to
    # a grid of lrs 2x or 3x apart (its offset drawn). Sizes that all found the same grid point gave an interval of
    # zero width; counting the rounding, the interval is never that and holds the true exponent in 95% or more.
    rng = np.random.default_rng(0)
    for sizes, step in ((3, 2.0), (4, 2.0), (4, 3.0)):
        held = same = 0
        for _ in range(400):
            params = list(PARAMS.values())[:sizes]
            grid = [1e-3 * step ** (k + rng.uniform(0, 1)) for k in range(-6, 7)]
            found = []
            for n in params:
                true = 1e-3 * (n / REFERENCE) ** -0.3 * math.exp(rng.normal(0.0, 0.05))
                found.append(min(grid, key=lambda g: abs(math.log(g / true))))
            low, high = fit_log_line(params, found, step).exponent_interval()
            assert high - low > 0.1
            held += low <= -0.3 <= high
            same += len(set(found)) == 1
        print(f"{sizes} sizes, grid step {step}: exponent held {held / 400:.4f}, one grid point at every size {same}")
        assert held / 400 >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / 400) and same > 0


def test_found_against_predicted_allows_half_a_grid_step_and_an_edge_is_a_bound_not_an_optimum():
    from tests.study.test_study import made_up_run
    from torchtitan.study.scale_report import format_scale_markdown, summarize_scale
    from torchtitan.study.summary import summarize_sweep

    # Three sizes whose best lr is 1e-3 on the grid 5e-4, 1e-3, 2e-3; a fourth whose best is 2e-3, its largest.
    def report(best: float) -> dict:
        runs = [
            made_up_run(o, s, (1.0 if lr == best else 1.1) * (1 + 0.01 * s), lr=lr)
            for o in ("AdamW", "AdamMini")
            for lr in (5e-4, 1e-3, 2e-3)
            for s in range(2)
        ]
        return summarize_sweep(runs, last_k=3)

    names = list(PARAMS)[:4]
    sizes = [
        {"size": f, "params": PARAMS[f], "folder": f, "report": report(2e-3 if f == names[3] else 1e-3)} for f in names
    ]
    view = summarize_scale(sizes, {}, "AdamW", 8e9)
    (law,) = [x for x in view["optimizers"]["AdamMini"]["laws"] if x["setting"] == "lr"]
    low, high = law["exponent_interval"]
    assert law["grid_step"] == 2.0 and high - low > 0.5  # three sizes on one point: wide, not zero width
    assert law["at_edge"] == {names[3]: "largest"}
    assert law["predicted_vs_found"][-1]["inside"] is None
    md = format_scale_markdown(view)
    assert f"at the grid's edge, a bound and not an optimum: {names[3]} the largest tried" in md
    assert "n/a: the largest tried, a bound" in md
    # Found 10% past the end of its prediction interval on a grid 1.5x apart: inside (a grid point within half a
    # step of a value inside it); 30% past: outside. The interval does not depend on the size's own found value.
    smaller = [("a", 1e7, 1e-3), ("b", 2e7, 1.01e-3), ("c", 4e7, 0.99e-3), ("d", 8e7, 1.0e-3)]
    high = predicted_against_found([*smaller, ("e", 1.6e8, 1e-3)], 1.5)[-1]["interval"][1]
    assert predicted_against_found([*smaller, ("e", 1.6e8, 1.1 * high)], 1.5)[-1]["inside"] is True
    assert predicted_against_found([*smaller, ("e", 1.6e8, 1.3 * high)], 1.5)[-1]["inside"] is False


def extrapolation_claims(rng, law, studies: int = 60) -> dict:
    """Over made-up studies of four sizes (30M to 300M, three seeds each, each seed's speedup off the ``law``'s
    by exp(0.02 Z)), what the scale view's speedup trend says at 8B (``size_trend``, as the view computes it): how
    often the power law's interval alone holds the truth, how often the page's claim does (the truth inside one of
    the two laws' intervals it shows, or the page saying that this ladder does not determine the value), and how
    often it says so."""
    from torchtitan.study.scale_report import size_trend

    truth = law(TARGET)
    counts = {"power": 0, "page": 0, "undetermined": 0}
    for _ in range(studies):
        points = []
        for name, n in list(PARAMS.items())[:4]:
            s = combine_speedups([(law(n) * math.exp(rng.normal(0.0, 0.02)), None) for _ in range(3)])
            points.append((name, TrendPoint(n, s.value, s.low, s.high, 2), None))
        trend = size_trend(points, TARGET, bends=True)
        power = trend["fit"]["target_interval"]
        bending = (trend.get("saturating") or {}).get("target_interval")
        inside = [iv is not None and iv[0] <= truth <= iv[1] for iv in (power, bending)]
        undetermined = trend.get("determined") is False
        counts["power"] += inside[0]
        counts["page"] += any(inside) or undetermined
        counts["undetermined"] += undetermined
    return {k: v / studies for k, v in counts.items()}


def test_past_the_ladder_a_bending_speedup_is_fitted_beside_the_power_law_and_the_page_holds_in_either_world():
    # A speedup that bends toward 1 (1 + 0.4 (N / N0)^-0.5): the power law alone put its 8B interval off the truth
    # in most studies; with the bending law beside it, and the page saying where the two disagree, what the page
    # says holds. A true power law (1.4 (N / N0)^-0.1): the same.
    rng = np.random.default_rng(4)
    bending = extrapolation_claims(rng, lambda n: 1.0 + 0.4 * (n / REFERENCE) ** -0.5)
    power = extrapolation_claims(rng, lambda n: 1.4 * (n / REFERENCE) ** -0.1)
    print(f"at 8B: bending world {bending}, power-law world {power}")
    assert bending["page"] >= 0.9 and power["page"] >= 0.9
    assert bending["power"] < 0.6 and bending["undetermined"] > 0.3


def test_the_page_shows_both_laws_at_the_target_and_says_when_the_ladder_does_not_determine_it():
    from torchtitan.study.scale_report import size_trend, trend_text

    points = [
        (
            name,
            TrendPoint(
                n,
                1.0 + 0.4 * (n / REFERENCE) ** -0.5,
                *(1.0 + 0.4 * (n / REFERENCE) ** -0.5) * np.array([0.99, 1.01]),
                2,
            ),
            None,
        )
        for name, n in list(PARAMS.items())[:4]
    ]
    text = trend_text("Speedup at matched loss", size_trend(points, TARGET, bends=True), TARGET)
    assert "at 8B parameters" in text and "Bending toward 1 instead (1 + a·N^b" in text
    assert "this ladder does not determine the value at the target" in text


def test_through_the_sweep_the_page_past_the_ladder_holds_the_truth_in_a_power_law_and_a_bending_world(tmp_path):
    # One study of four sizes (30M to 293M) on the fake trainer, three seeds a size, two made-up worlds side by side:
    # AdamMini's speedup over AdamW a power law, 1.4 (N / N0)^-0.1 (0.80x at 8B); Adam's one that bends toward 1,
    # 1 + 1.5 (N / N0)^-0.4 (2.5x at 30M, 1.6x at 293M, 1.16x at 8B, where a power law through the same sizes says
    # about 0.85x). Each seed off its law by exp(0.02 Z). What the page says at 8B, 27x past the largest size:
    law = {**LAW, "lr_exponent": 0.0, "speedups": {"AdamMini": 1.4}, "bends": {"Adam": [1.5, -0.4]}, "noise": 0.02}
    ladder = ",".join(list(PARAMS)[:4])
    args = ["--optimizers", "AdamW,AdamMini,Adam", "--lrs", "1e-3", "--seeds", "0,1,2", "--ladder", ladder]
    train = ["--target-params", "8e9", "--parallel", "2", "--", "--training.steps", "30"]
    assert fake_sweep(tmp_path / "study", *args, *train, FAKE_SCALE=json.dumps(law)) == 0
    view = json.loads((tmp_path / "study" / "scale.json").read_text())
    md = (tmp_path / "study" / "sweep.md").read_text()
    assert "27.3× past the largest size trained (293M)" in md
    # One lr given at every size: nothing searched, so no law of the best lr (it read N^+0.000 [+0.000, +0.000]).
    assert all(entry["laws"] == [] for entry in view["optimizers"].values()) and "best lr at" not in md

    def inside(interval, truth: float) -> bool:  # an end the page cannot bound is stored as null
        return (interval[0] is None or interval[0] <= truth) and (interval[1] is None or truth <= interval[1])

    # The power-law world: the power law's interval holds the truth, and the page gives it as the value at 8B.
    power = view["optimizers"]["AdamMini"]["speedup_trend"]
    truth = 1.4 * (TARGET / REFERENCE) ** -0.1
    assert power["fit"]["sizes"] == 4 and inside(power["fit"]["target_interval"], truth)
    assert power["determined"] is True
    low, high = power["fit"]["target_interval"]
    assert f"at 8B parameters {power['fit']['at_target']:.2f}× [{low:.2f}, {high:.2f}]" in md
    # The bending world: the power law alone would put the target off the truth; the page shows the bending law's
    # value, its interval holding the truth, and says that the ladder does not determine the value at the target.
    bending = view["optimizers"]["Adam"]["speedup_trend"]
    truth = 1.0 + 1.5 * (TARGET / REFERENCE) ** -0.4
    assert bending["fit"]["sizes"] == 4 and not inside(bending["fit"]["target_interval"], truth)
    assert inside(bending["saturating"]["target_interval"], truth) and bending["determined"] is False
    adam = md[md.index("## Adam\n") :]
    line = next(x for x in adam.splitlines() if x.startswith("Speedup at matched loss ∝"))
    low, high = bending["saturating"]["target_interval"]
    shown = f"{bending['saturating']['at_target']:.2f}× at 8B [{low:.2f}, {high:.2f}]"
    assert f"Bending toward 1 instead (1 + a·N^b, as a speedup that fades with size): {shown}" in line
    assert "this ladder does not determine the value at the target" in line
    assert "does not determine" not in md[md.index("## AdamMini\n") : md.index("## Adam\n")]
