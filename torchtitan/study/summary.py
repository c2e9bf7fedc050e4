"""The numbers of runs: one run's summary (compare_runs' table and the sweep's ranking read the same one) and a
study's verdict: cells of (optimizer, budget, settings) over seeds, each optimizer's best settings, its difference
from a baseline with Welch's interval, its speedup at matched loss, and the fit of the baseline's loss over budgets.

Pure functions of logged scalars, statuses and dataset facts; reading them is ``runs.py``, the statistics
``statistics.py``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.study import selection, statistics
from torchtitan.study.plan import DIVERGED, FAILED, FINISHED, RUNS_FOLDER, lr_label
from torchtitan.study.run_folders import (
    LOSS,
    MEMORY_TAGS,
    STATE_BYTES,
    TOKENS_SEEN,
    TPS,
    VALIDATION_LOSS,
    Series,
    SweepRun,
)
from torchtitan.study.run_status import diverged_at_step, first_non_finite_step  # noqa: F401 (their home)

DEFAULT_BASELINE = "AdamW"
# Tokens/s leaves out the first logged values: the steps they cover include torch.compile's compilation (and a fused
# optimizer step's), which would halve the throughput of a short run. A run with no more values keeps its last one.
TPS_WARMUP_LOGS = 2


def steady_tps(values: Sequence[float]) -> list[float]:
    """The tokens/s values logged after compilation: all but the first ``TPS_WARMUP_LOGS`` (the last one at least)."""
    return list(values[TPS_WARMUP_LOGS:]) or list(values[-1:])


def mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def finite(values: Sequence[float]) -> list[float]:
    """The finite values among ``values``: a NaN or infinite throughput, memory or count logged by a run says
    nothing about it (its loss is judged apart, by :func:`diverged_at_step`)."""
    return [v for v in values if math.isfinite(v)]


def _last_finite(series: Optional[Series]) -> Optional[float]:
    values = finite(series.values) if series else []
    return values[-1] if values else None


def summarize(scalars: dict[str, Series], last_k: int) -> dict:
    """One run's numbers; None where the run did not log the tag.

    ``final_loss`` is the mean of the last ``last_k`` logged training losses and ``validation_loss`` the last one
    logged; both are None for a run that diverged (``diverged_at_step`` set).
    """
    loss = scalars.get(LOSS)
    tail = loss.values[-last_k:] if loss else ()
    diverged_at = diverged_at_step(scalars)
    memory_tag = next((t for t in MEMORY_TAGS if finite(scalars.get(t, Series((), ())).values)), None)
    validation = scalars.get(VALIDATION_LOSS)
    state, seen = _last_finite(scalars.get(STATE_BYTES)), _last_finite(scalars.get(TOKENS_SEEN))
    return {
        "last_step": loss.steps[-1] if loss else None,
        "final_loss": mean_std(tail)[0] if diverged_at is None and tail else None,
        "final_loss_steps": len(tail),
        "validation_loss": validation.values[-1] if validation and validation.values and diverged_at is None else None,
        "diverged_at_step": diverged_at,
        "mean_tps": mean_std(steady_tps(finite(scalars[TPS].values)))[0] if TPS in scalars else None,
        "peak_memory_gib": max(finite(scalars[memory_tag].values)) if memory_tag else None,
        "peak_memory_tag": memory_tag,
        "optimizer_state_bytes": None if state is None else int(round(state)),
        "tokens_seen": None if seen is None else int(round(seen)),
    }


# ----------------------------------------------------------------------------------------------------------------
# A study


def run_settings(run: SweepRun) -> dict:
    """The swept settings of a run other than its seed and budget: its lr and any ``options`` its status records
    (further sweep axes), keyed by option name."""
    return {"lr": run.spec.lr, **run.status.get("options", {})}


def settings_label(settings: dict) -> str:
    return ", ".join(f"lr {lr_label(v)}" if k == "lr" else f"{k} {v}" for k, v in settings.items())


def settings_order(settings: dict) -> list:
    """Sort key of settings: by option name, numbers by value (1e-4 before 3e-3), other values by their text."""
    return [(k, 0, v, "") if isinstance(v, (int, float)) else (k, 1, 0, str(v)) for k, v in sorted(settings.items())]


def _key(settings: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def sweep_run_summary(run: SweepRun, last_k: int, by_validation: bool) -> dict:
    """A sweep run's spec, outcome and numbers; ``rank_loss`` is what ranks its settings (None unless it
    finished), ``rank_tokens`` the tokens it had trained on at that loss."""
    status = run.status
    summary = {
        "name": run.spec.name,
        "optimizer": run.spec.optimizer,
        "lr": run.spec.lr,
        "seed": run.spec.seed,
        "settings": run_settings(run),
        "budget": status.get("budget"),
        "budget_label": status.get("budget_label"),  # as the study gave it: "2x" (tokens per parameter) or "1M"
        "data_seed": status.get("data_seed", (run.dataset or {}).get("data_seed")),
        "outcome": status["outcome"],
        "exit_code": status["exit_code"],
        "message": status.get("message"),
        **({"requeues": status["requeues"]} if status.get("requeues") else {}),  # Slurm: requeued so many times
        # Where it ran and with what, relative to the sweep's folder: its folder, command.sh and job_config.toml.
        "folder": f"{RUNS_FOLDER}/{run.spec.name}",
        "config": None if run.config is None else f"{RUNS_FOLDER}/{run.spec.name}/{run.config}",
        "seconds": status.get("seconds"),
        **summarize(run.scalars, last_k),
    }
    if status["outcome"] != FINISHED:  # e.g. stopped by the guard (exit 3) before anything non-finite was logged
        summary["final_loss"] = summary["validation_loss"] = None
    summary["rank_loss"] = summary["validation_loss"] if by_validation else summary["final_loss"]
    if status["outcome"] == FINISHED and summary["rank_loss"] is None:
        # It ended well but left no loss to rank: a non-finite one logged on the way (the run diverged, whatever its
        # exit), or none at all. Judged as a seed that gives no loss, said in its own words.
        tag = VALIDATION_LOSS if by_validation else LOSS
        if summary["diverged_at_step"] is not None:
            summary["outcome"] = DIVERGED
            summary["message"] = f"exited 0 but logged a non-finite loss at step {summary['diverged_at_step']}"
        else:
            summary["outcome"] = FAILED
            summary["message"] = f"exited 0 but logged no {tag}: nothing to rank"
    curve = raw_curve(run.scalars, by_validation)
    ranked = curve is not None and summary["rank_loss"] is not None
    summary["rank_tokens"] = curve[0][-1] if ranked else None
    # The tokens of the logged points its ranked loss averages: the last validation loss, or the last k losses.
    summary["rank_window"] = (curve[0][-1:] if by_validation else curve[0][-last_k:]) if ranked else None
    return summary


def tokens_at(scalars: dict[str, Series], steps: Sequence[int]) -> list[float]:
    """Tokens trained on after each step: the logged tokens_seen per step (a sweep's runs keep one batch size),
    or the step itself where a run did not log them (a ratio of tokens is then a ratio of steps)."""
    seen = scalars.get(TOKENS_SEEN)
    known = [(s, v) for s, v in zip(seen.steps, seen.values) if math.isfinite(v) and s > 0] if seen else []
    per_step = known[-1][1] / known[-1][0] if known else 1.0
    return [step * per_step for step in steps]


def raw_curve(scalars: dict[str, Series], by_validation: bool) -> Optional[tuple[list, list]]:
    """(tokens, loss) as logged, of the loss a study ranks by (validation, or training); None without that tag."""
    series = scalars.get(VALIDATION_LOSS if by_validation else LOSS)
    if series is None or not series.steps:
        return None
    return tokens_at(scalars, series.steps), list(series.values)


def loss_curve(scalars: dict[str, Series], by_validation: bool, last_k: int) -> Optional[tuple[list, list]]:
    """(tokens, loss) of the loss a study ranks by: the validation losses, or the training loss as the trailing
    mean of ``last_k`` logged values (its last point is then the run's final loss). None without that tag."""
    series = scalars.get(VALIDATION_LOSS if by_validation else LOSS)
    if series is None or not series.steps:
        return None
    values = list(series.values) if by_validation else statistics.trailing_mean(series.values, last_k)
    return tokens_at(scalars, series.steps), values


def _cell(optimizer: str, budget, settings: dict, group: Sequence[dict]) -> dict:
    """One (optimizer, budget, settings) over its seeds: diverged if any seed diverged, else failed if any failed."""
    outcomes = [r["outcome"] for r in group]
    outcome = DIVERGED if DIVERGED in outcomes else FAILED if FAILED in outcomes else FINISHED
    losses = [r["rank_loss"] for r in group if r["outcome"] == FINISHED]
    mean, std = mean_std(losses)
    ci = statistics.mean_ci(losses) if len(losses) > 1 else None
    return {
        "optimizer": optimizer,
        "budget": budget,
        "settings": settings,
        "lr": settings["lr"],
        "seeds": sorted(r["seed"] for r in group),
        "outcome": outcome,
        "runs_diverged": outcomes.count(DIVERGED),
        "runs_failed": outcomes.count(FAILED),
        "loss_mean": mean if outcome == FINISHED else None,
        "loss_std": std if outcome == FINISHED else None,
        "loss_ci": ci if outcome == FINISHED else None,
    }


def _best(mine: Sequence[dict], cells: Sequence[dict]) -> dict:
    """An optimizer's best settings at one budget (among cells where no seed diverged or failed, as
    :func:`selection.choose_settings` chooses them: fitted along each numeric setting), its speed and memory."""
    choice = selection.choose_settings([(c["settings"], _seed_losses(mine, c)) for c in cells])
    winner = next(c for c in cells if _key(c["settings"]) == _key(choice.settings)) if choice else None
    completed = [r for r in mine if r["outcome"] == FINISHED]
    tps = [r["mean_tps"] for r in completed if r["mean_tps"] is not None]
    memory = [r["peak_memory_gib"] for r in completed if r["peak_memory_gib"] is not None]
    state = [r["optimizer_state_bytes"] for r in mine if r["optimizer_state_bytes"] is not None]
    return {
        "lr": winner["lr"] if winner else None,
        "settings": winner["settings"] if winner else None,
        "loss_mean": winner["loss_mean"] if winner else None,
        "loss_std": winner["loss_std"] if winner else None,
        "loss_ci": winner["loss_ci"] if winner else None,
        "seeds": winner["seeds"] if winner else [],
        # Throughput and memory do not depend on the settings: taken over all the optimizer's finished runs.
        "mean_tps": mean_std(tps)[0],
        "min_tps": min(tps, default=None),
        "max_tps": max(tps, default=None),
        "peak_memory_gib": max(memory, default=None),
        "peak_memory_tag": next((r["peak_memory_tag"] for r in mine if r["peak_memory_tag"]), None),
        "optimizer_state_bytes": max(state, default=None),
        "choice": choice.to_json() if choice else None,
    }


def _seed_losses(mine: Sequence[dict], cell: dict) -> Optional[dict]:
    """A finished cell's ranked loss per seed, for the choice of settings; None for one that did not finish."""
    if cell["outcome"] != FINISHED or cell["loss_mean"] is None:
        return None
    return {r["seed"]: r["rank_loss"] for r in cell_runs(mine, cell["optimizer"], cell["budget"], cell["settings"])}


def check_same_data(runs: Sequence[SweepRun]) -> dict:
    """The data every run read, from its ``dataset.json``: runs that read different fingerprinted data are
    refused (a ranking of them would compare data, not optimizers); runs without a fingerprint are named."""
    fingerprints: dict[str, str] = {}
    unknown = []
    for run in runs:
        fingerprint = (run.dataset or {}).get("fingerprint")
        if fingerprint is None:
            unknown.append(run.spec.name)
        else:
            fingerprints.setdefault(fingerprint, run.spec.name)
    if len(fingerprints) > 1:
        (a, name_a), (b, name_b) = list(fingerprints.items())[:2]
        raise UserError(
            f"the sweep's runs read different data ({name_a}: dataset fingerprint {a}, {name_b}: {b}); the sweep "
            "ranks only runs on the same data: give every run the same dataset, or put them in separate dump folders"
        )
    sources = sorted({str(r.dataset["source"]) for r in runs if r.dataset and r.dataset.get("source") is not None})
    return {
        "fingerprint": next(iter(fingerprints), None),
        "sources": sources,
        "not_fingerprinted": unknown,
    }


def seeds_varied(summaries: Sequence[dict]) -> str:
    """What changed from seed to seed: the initial weights always (training.seed), the data order when the runs of
    one cell read different data seeds."""
    if len({r["seed"] for r in summaries}) < 2:
        return "one seed per cell: nothing varied"
    by_cell: dict[tuple, set] = {}
    for r in summaries:
        by_cell.setdefault((r["optimizer"], r["budget"], _key(r["settings"])), set()).add(r["data_seed"])
    data_seeds = {s for seeds in by_cell.values() for s in seeds}
    if any(len(seeds) > 1 for seeds in by_cell.values()):
        return "model initialisation (training.seed) and data order (training.data_seed)"
    if data_seeds == {None}:
        return "model initialisation (training.seed); data order fixed (no data seed recorded)"
    return f"model initialisation (training.seed); data order fixed (data seed {', '.join(map(str, data_seeds))})"


PAIRED_SPEEDUP = "paired on (training seed, data seed)"
UNPAIRED_SPEEDUP = "unpaired: each seed against each of the baseline's (Welch)"


def _seed_key(run: dict) -> tuple:
    return run["seed"], run["data_seed"]


def _speedup_of(
    chosen: Sequence[dict], baseline: Sequence[dict], curves: dict[str, tuple[list, list]]
) -> Optional[dict]:
    """Speedup at matched loss of one best cell against the baseline's best cell at the same budget, read along
    the baseline's raw curve at each run's final loss, or along the run's own at the baseline's where the baseline's
    ends first (``curves``: raw curves by run name; :func:`statistics.two_way_ratio`): paired seed by seed on the
    (training seed, data seed) pairs both ran, as the loss difference pairs them, where they share two or more (or
    all); else every seed against every seed of the baseline (:func:`statistics.unpaired_speedup`)."""
    finished = [r for r in chosen if _ranked(r) and r.get("rank_window")]
    base = {_seed_key(r): r for r in baseline if r["name"] in curves and _ranked(r) and r.get("rank_window")}
    if not finished or not base:
        return None
    mine = {_seed_key(r): r for r in finished}

    def final(r: dict) -> tuple:
        return r["rank_loss"], r["rank_window"]

    shared = sorted(set(mine) & set(base), key=repr)
    left_out = sorted(set(mine) ^ set(base), key=repr)
    if shared and (not left_out or len(shared) >= 2):
        s = statistics.speedup_at_matched_loss(
            [curves[base[k]["name"]] for k in shared],
            [final(mine[k]) for k in shared],
            run_curves=[curves.get(mine[k]["name"]) for k in shared],
            baseline_finals=[final(base[k]) for k in shared],
        )
        per_seed = [{"seed": k[0], "ratio": x, "bound": b} for k, (x, b) in zip(shared, s.per_seed)]
        matched = PAIRED_SPEEDUP
    else:
        keys, base_keys, left_out = sorted(mine), sorted(base), []
        s, matrix = statistics.unpaired_speedup(
            [curves[base[k]["name"]] for k in base_keys],
            [final(mine[k]) for k in keys],
            run_curves=[curves.get(mine[k]["name"]) for k in keys],
            baseline_finals=[final(base[k]) for k in base_keys],
        )
        per_seed = [
            {"seed": k[0], "baseline_seed": j[0], "ratio": x, "bound": b}
            for k, row in zip(keys, matrix)
            for j, (x, b) in zip(base_keys, row)
        ]
        matched = UNPAIRED_SPEEDUP
    return {
        "value": s.value,
        "bound": s.bound,
        "low": s.low,
        "high": s.high,
        "level": s.level,
        "seeds": s.seeds,
        "per_seed": per_seed,
        "matched": matched,
        "seeds_left_out": [seed for seed, _ in left_out],
    }


def _own_speedup(chosen: Sequence[dict]) -> dict:
    """The baseline against itself: exactly 1, whatever the last bits of its curve and its final loss say."""
    n = sum(1 for r in chosen if _ranked(r))
    return {"value": 1.0, "bound": None, "low": None, "high": None, "seeds": n, "per_seed": [], "matched": "itself"}


def _versus(chosen: Sequence[dict], baseline: Sequence[dict]) -> Optional[dict]:
    """The difference of ranked losses from the baseline's: the paired t interval over the (training seed, data
    seed) pairs both sides ran (same initial weights and data order, seed by seed) where they share two or more,
    the seeds only one side ran left out and named; else Welch's interval over every seed."""
    mine = {(r["seed"], r["data_seed"]): r["rank_loss"] for r in chosen if _ranked(r)}
    theirs = {(r["seed"], r["data_seed"]): r["rank_loss"] for r in baseline if _ranked(r)}
    pairs = sorted(set(mine) & set(theirs), key=repr)
    left_out = sorted(set(mine) ^ set(theirs), key=repr) if len(pairs) >= 2 else []
    if len(pairs) >= 2:
        d = statistics.paired_difference([mine[p] for p in pairs], [theirs[p] for p in pairs])
    else:
        d = statistics.welch_difference(list(mine.values()), list(theirs.values()))
    if d is None:
        return None
    return {
        "seeds_left_out": [seed for seed, _ in left_out],
        "difference": d.difference,
        "low": d.low,
        "high": d.high,
        "df": d.df,
        "method": d.method,
        "verdict": d.verdict,
        "p_value": d.p_value,
    }


def _no_verdict_reason(
    optimizer: str, b: dict, baseline: str, base: Optional[dict], chosen: Sequence[dict], base_runs: Sequence[dict]
) -> str:
    """Why a best cell has no difference from the baseline's, in words: the first reason that holds."""
    if base is None:
        return f"no verdict: {baseline} has no run at this budget"
    if base["settings"] is None:
        return f"no verdict: every setting of {baseline} had a seed that diverged or failed"
    if not base_runs:
        return f"no verdict: {baseline}'s best settings have no runs to judge"
    sides = ((optimizer, [r for r in chosen if _ranked(r)]), (baseline, [r for r in base_runs if _ranked(r)]))
    one = [name for name, runs in sides if len(runs) < 2]
    if one:
        has = "has" if len(one) == 1 else "have"
        return f"no verdict: {' and '.join(one)} {has} one ranked seed (a verdict needs two or more)"
    return "no verdict"


HOLM, UNADJUSTED = "Holm", "unadjusted"
FAMILY_CORRECTIONS = (HOLM, UNADJUSTED)


def verdict_family(best_by_budget: dict, correction: str = HOLM) -> dict:
    """The verdicts as one family: every difference from the baseline the report computed (each optimizer at each
    budget) that has a p-value. With Holm's correction each verdict's words come from its Holm-adjusted p (better /
    worse where it is below 0.05, by the sign of the difference), so that the chance of any false "better" or
    "worse" among them stays at 5%; the unadjusted verdict and interval are kept beside it."""
    if correction not in FAMILY_CORRECTIONS:
        raise ValueError(f"no family correction {correction!r}; one of {', '.join(FAMILY_CORRECTIONS)}")
    members = [
        b["versus_baseline"]
        for best in best_by_budget.values()
        for b in best.values()
        if b.get("versus_baseline") is not None and b["versus_baseline"]["p_value"] is not None
    ]
    if correction == HOLM:
        for v, p in zip(members, statistics.holm_adjusted([v["p_value"] for v in members])):
            v["unadjusted_verdict"], v["p_holm"] = v["verdict"], p
            significant = p < 1.0 - statistics.CONFIDENCE
            v["verdict"] = (
                (statistics.BETTER if v["difference"] < 0 else statistics.WORSE)
                if significant
                else (statistics.NO_DIFFERENCE)
            )
    return {"comparisons": len(members), "correction": correction}


def _ranked(run: dict) -> bool:
    return run["outcome"] == FINISHED and run["rank_loss"] is not None


def _by_seed(b: dict) -> dict:
    return {tuple(k): loss for k, loss in zip(b["seed_keys"], b["seed_losses"])}


def budget_fit(best_by_budget: dict, baseline: str, summaries: Sequence[dict]) -> Optional[dict]:
    """L(D) = alpha * D^(-beta) + gamma over the baseline's best cell at each budget (three or more), and each
    optimizer's D_eff / D at each budget: the budget the fitted baseline needs for that optimizer's loss over its
    own (the baseline's own is 1 by definition); each with a 95% bootstrap interval over seeds, a target that ran
    the baseline's seeds at its budget drawn with the baseline's point there. None with fewer than three budgets
    where the baseline finished."""
    points = []  # (tokens, loss, budget, the baseline's best cell)
    for budget, best in best_by_budget.items():
        b = best.get(baseline)
        if budget is not None and b and b["loss_mean"] is not None and b["seed_losses"]:
            points.append((_cell_tokens(summaries, baseline, budget, b["settings"]), b["loss_mean"], budget, b))
    if len(points) < 3:
        return None
    points.sort(key=lambda p: p[:2])
    fit = statistics.fit_power_law([p[0] for p in points], [p[1] for p in points])
    result = {
        "baseline": baseline,
        "points": [{"tokens": d, "loss": loss} for d, loss, _, _ in points],
        "fit": None,
        "exact": len(points) == 3,  # three parameters through three points: no residual to judge the fit by
    }
    if fit is None:
        result["error"] = (
            f"{baseline}'s best loss does not fall with the budget as a power law with a floor at or above zero: "
            "no fit (more or longer budgets may give one)"
        )
        return result
    result["fit"] = {"alpha": fit.alpha, "beta": fit.beta, "gamma": fit.gamma, "rms_residual": fit.rms_residual}
    point_at = {budget: i for i, (_, _, budget, _) in enumerate(points)}
    speedups, targets = {}, []
    for budget, best in best_by_budget.items():
        for optimizer, b in best.items():
            if budget is None or b["loss_mean"] is None or not b["seed_losses"]:
                continue
            tokens = _cell_tokens(summaries, optimizer, budget, b["settings"])
            itself = optimizer == baseline
            d_eff = tokens if itself else fit.tokens_for(b["loss_mean"])
            entry = {
                "budget": budget,
                "tokens": tokens,
                "loss": b["loss_mean"],
                "d_eff": None if math.isinf(d_eff) else d_eff,
                "speedup": None if math.isinf(d_eff) else d_eff / tokens,
                "below_floor": math.isinf(d_eff),
                "interval": None,
            }
            speedups.setdefault(optimizer, []).append(entry)
            if itself:
                entry["interval_note"] = "1 by definition: the baseline against its own fit"
                continue
            target = _fit_target(b, tokens, points, point_at.get(budget))
            targets.append((entry, target, optimizer))
    result["speedups"] = {o: sorted(v, key=lambda x: x["budget"]) for o, v in speedups.items()}
    why = _no_interval_reason([(f"{baseline} at {p[0]:,.0f} tokens", p[3]["seed_losses"]) for p in points])
    why = why or _no_interval_reason([(f"{o} at {t.tokens:,.0f} tokens", t.losses) for _, t, o in targets])
    if why is not None:
        result["interval"], result["interval_note"] = None, f"no bootstrap interval: {why}"
        for entry, _, _ in targets:
            entry["interval_note"] = result["interval_note"]
        return result
    interval = statistics.bootstrap_power_law([(p[0], p[3]["seed_losses"]) for p in points], [t for _, t, _ in targets])
    failed = interval.failed
    result["interval"] = {
        "alpha": _ends(interval.alpha),
        "beta": _ends(interval.beta),
        "gamma": _ends(interval.gamma),
        "fits": interval.fits,
        "failed": failed,
        "resamples": interval.resamples,
    }
    no_fit = f"{failed} of {interval.resamples} resamples found no power law"
    for (entry, target, _), (low, high), below in zip(targets, interval.speedups, interval.below_floor):
        entry["interval"] = _ends((low, high))
        entry["paired"] = target.paired_with is not None
        notes = []
        if math.isinf(low):
            notes.append(f"no lower end: {no_fit}")
        if math.isinf(high):
            notes.append(
                f"no upper end: {below} of {interval.resamples} resamples put this loss at or below the fit's floor"
                if below
                else f"no upper end: {no_fit}"
            )
        if notes:
            entry["interval_note"] = "; ".join(notes)
    return result


def _ends(interval: tuple[float, float]) -> list:
    """An interval for JSON: an end at infinity (no number holds it) is null; the report says why."""
    return [None if math.isinf(x) else x for x in interval]


def _fit_target(b: dict, tokens: float, points: Sequence[tuple], at: Optional[int]) -> statistics.FitTarget:
    """An optimizer's cell as a target of the fit, paired with the baseline's point at its budget when both ran the
    same (training seed, data seed) pairs."""
    mine = _by_seed(b)
    if at is not None:
        theirs = _by_seed(points[at][3])
        if sorted(mine) == sorted(theirs):  # the target's losses in the order of the point's
            order = [tuple(k) for k in points[at][3]["seed_keys"]]
            return statistics.FitTarget(tokens, [mine[k] for k in order], at)
    return statistics.FitTarget(tokens, b["seed_losses"])


def _no_interval_reason(cells: Sequence[tuple[str, Sequence[float]]]) -> Optional[str]:
    """Why no bootstrap interval can be given, naming the cells: one seed, or seeds that varied nothing."""
    one = [name for name, losses in cells if len(losses) < 2]
    if one:
        return f"{', '.join(one)} {'has' if len(one) == 1 else 'have'} one seed (two or more give an interval)"
    flat = [name for name, losses in cells if statistics.varied_nothing(losses)]
    if flat:
        return f"the seeds of {', '.join(flat)} varied nothing (no spread to draw from)"
    return None


def cell_runs(summaries: Sequence[dict], optimizer: str, budget, settings: Optional[dict]) -> list[dict]:
    """The run summaries (one per seed) of the cell (optimizer, budget, settings)."""
    if settings is None:
        return []
    return [
        r
        for r in summaries
        if r["optimizer"] == optimizer and r["budget"] == budget and _key(r["settings"]) == _key(settings)
    ]


def _cell_tokens(summaries: Sequence[dict], optimizer: str, budget, settings: dict) -> float:
    """Mean tokens trained on by a cell's finished runs at their ranked loss."""
    runs = cell_runs(summaries, optimizer, budget, settings)
    return statistics.mean([r["rank_tokens"] for r in runs if r["rank_tokens"] is not None])


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def grid_edges(settings: dict, cells: Sequence[dict]) -> list[dict]:
    """The swept numeric settings of ``settings`` that sit at an end of the values its optimizer's cells tried (a
    descent that converged tried both neighbours of an inner point): its optimum may lie beyond the grid."""
    edges = []
    for key, value in settings.items():
        tried = sorted({c["settings"][key] for c in cells if _number(c["settings"].get(key))})
        if len(tried) < 2 or not _number(value):
            continue
        if value in (tried[0], tried[-1]):
            edges.append({"setting": key, "value": value, "end": "smallest" if value == tried[0] else "largest"})
    return edges


CONFIRMATION_PENDING = "pending"  # a best cell's confirmation while some of its confirmation seeds have not ended


def _confirm(b: dict, optimizer: str, budget, runs: Sequence[dict], confirm_seeds: int) -> None:
    """Replace a best cell's loss by that of its confirmation runs (the seeds it was not chosen on), judged as the
    selection judges a cell: ``confirmation`` is "pending" until every confirmation seed ended, then the cell's
    outcome (diverged if any seed diverged, failed if any failed, else finished); only a finished one has a loss."""
    cell = _cell(optimizer, budget, b["settings"], runs)
    state = CONFIRMATION_PENDING if len(runs) < confirm_seeds else cell["outcome"]
    b["selection"] = {k: b[k] for k in ("loss_mean", "loss_ci", "seeds")}
    b["confirmation"] = state
    done = state == FINISHED
    b["loss_mean"], b["loss_std"], b["loss_ci"] = (
        cell[k] if done else None for k in ("loss_mean", "loss_std", "loss_ci")
    )
    # The winner's curse: how much lower the chosen cell looked on the seeds that chose it than on fresh ones.
    b["winners_curse"] = b["selection"]["loss_mean"] - b["loss_mean"] if done else None
    b["seeds"] = cell["seeds"]


def _judged(b: Optional[dict]) -> bool:
    """Whether a best cell has runs to judge it by: settings, and, under confirmation, every confirmation seed
    finished (a verdict never reads the seeds that happened to survive)."""
    return b is not None and b["settings"] is not None and b.get("confirmation", FINISHED) == FINISHED


def _of_current_axes(run: dict, current_axes: dict) -> bool:
    return set(run["settings"]) - {"lr"} == set(current_axes.get(run["optimizer"], []))


def summarize_sweep(
    runs: Sequence[SweepRun],
    last_k: int,
    baseline: str = DEFAULT_BASELINE,
    confirm_seeds: Sequence[int] = (),
    current_axes: Optional[dict] = None,
    family_correction: str = HOLM,
) -> dict:
    """Per run; per cell (optimizer, budget, settings) over seeds; per optimizer its best settings at each budget,
    compared with the baseline's best (difference with a paired or Welch's 95% interval, speedup at matched loss);
    and, with three or more budgets, the baseline's power-law fit with bootstrap intervals. ``best`` is the verdict
    at the largest budget.

    With ``confirm_seeds`` the cells and best settings come from the other (selection) seeds only, and the verdict
    from the runs of the best settings on the confirmation seeds only, so that choosing the best of many settings
    cannot favour an optimizer by the luck of its seeds. With ``current_axes`` (optimizer: its swept options other than
    the lr) only the runs of those options are ranked; the others (``older_runs``) are listed apart."""
    data = check_same_data(runs)
    finished = [r for r in runs if r.status["outcome"] == FINISHED and r.scalars.get(LOSS)]
    by_validation = bool(finished) and all(VALIDATION_LOSS in r.scalars for r in finished)
    every = [sweep_run_summary(r, last_k, by_validation) for r in runs]
    confirming = set(confirm_seeds)
    older = [r for r in every if current_axes is not None and not _of_current_axes(r, current_axes)]
    ranked = [r for r in every if r not in older]
    summaries = [r for r in ranked if r["seed"] not in confirming]
    confirmations = [r for r in ranked if r["seed"] in confirming]
    optimizers = list(dict.fromkeys(r["optimizer"] for r in every))
    budgets = sorted({r["budget"] for r in every}, key=lambda b: (b is not None, b or 0))
    grid, best_by_budget = [], {}
    for budget in budgets:
        best_by_budget[budget] = {}
        for optimizer in optimizers:
            mine = [r for r in summaries if r["optimizer"] == optimizer and r["budget"] == budget]
            if not mine:
                continue
            settings = {_key(r["settings"]): r["settings"] for r in mine}
            cells = [
                _cell(optimizer, budget, s, cell_runs(mine, optimizer, budget, s))
                for s in sorted(settings.values(), key=settings_order)
            ]
            grid.extend(cells)
            b = best_by_budget[budget][optimizer] = _best(mine, cells)
            b["settings_tried"] = len(cells)
            b["edges"] = grid_edges(b["settings"], cells) if b["settings"] else []
            if confirming and b["settings"] is not None:
                _confirm(
                    b, optimizer, budget, cell_runs(confirmations, optimizer, budget, b["settings"]), len(confirming)
                )

    # The comparison with the baseline needs the curves of the best cells only (their confirmation runs if any).
    verdict_runs = confirmations if confirming else summaries
    by_name = {r.spec.name: r for r in runs}
    for budget, best in best_by_budget.items():
        base = best.get(baseline)
        base_runs = cell_runs(verdict_runs, baseline, budget, base["settings"]) if _judged(base) else []
        curves = {}  # the raw curves of the runs the verdict compares: the baseline's and every best cell's
        best_runs = [
            r for o, b in best.items() if _judged(b) for r in cell_runs(verdict_runs, o, budget, b["settings"])
        ]
        for r in best_runs:
            if r["outcome"] == FINISHED:
                curve = raw_curve(by_name[r["name"]].scalars, by_validation)
                if curve is not None:
                    curves[r["name"]] = curve
        for optimizer, b in best.items():
            chosen = cell_runs(verdict_runs, optimizer, budget, b["settings"]) if _judged(b) else []
            b["seed_losses"] = [r["rank_loss"] for r in chosen if _ranked(r)]
            b["seed_keys"] = [list(_seed_key(r)) for r in chosen if _ranked(r)]  # in the order of seed_losses
            if optimizer == baseline:
                b["versus_baseline"] = None
                b["speedup"] = _own_speedup(chosen) if b["seed_losses"] else None
                continue
            b["versus_baseline"] = _versus(chosen, base_runs) if base_runs else None
            if b["versus_baseline"] is None:
                b["no_verdict"] = _no_verdict_reason(optimizer, b, baseline, base, chosen, base_runs)
            b["speedup"] = _speedup_of(chosen, base_runs, curves) if curves else None

    family = verdict_family(best_by_budget, family_correction)
    ranked_by = f"last {VALIDATION_LOSS}" if by_validation else f"mean of the last {last_k} logged training losses"
    # Seeds per cell, or per verdict when confirmation seeds outnumber the selection's.
    verdict_seeds = [len(b["seeds"]) for best in best_by_budget.values() for b in best.values()]
    seeds = max([len(c["seeds"]) for c in grid] + verdict_seeds, default=0)
    return {
        "ranked_by": ranked_by,
        "by_validation": by_validation,
        "curve": "validation loss"
        if by_validation
        else f"training loss, trailing mean of the last {last_k} logged values",
        "last_k": last_k,
        "baseline": baseline,
        "baseline_found": baseline in optimizers,
        "seeds": seeds,
        "selection_seeds": sorted({r["seed"] for r in summaries}),
        "confirmation_seeds": sorted(confirming),
        "older_runs": [r["name"] for r in older],
        "seeds_varied": seeds_varied(every),
        "data": data,
        "runs": every,
        "grid": grid,
        "budgets": [b for b in budgets if b is not None],
        "best_by_budget": [{"budget": budget, "best": best} for budget, best in best_by_budget.items()],
        "best": best_by_budget[budgets[-1]] if budgets else {},
        "budget_fit": budget_fit(best_by_budget, baseline, verdict_runs),
        "family": family,
    }
