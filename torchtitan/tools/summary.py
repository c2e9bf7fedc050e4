"""The numbers of runs: one run's summary (compare_runs' table and the sweep's ranking read the same one) and a
sweep's grid of (optimizer, lr) cells over seeds with each optimizer's best lr.

Pure functions of logged scalars and statuses; reading them is ``runs.py``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from torchtitan.tools.runs import (
    GRAD_NORM,
    LOSS,
    MEMORY_TAGS,
    STATE_BYTES,
    TOKENS_SEEN,
    TPS,
    VALIDATION_LOSS,
    Series,
    SweepRun,
)
from torchtitan.tools.sweep_plan import DIVERGED, FAILED, FINISHED


def mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def first_non_finite_step(series: Series) -> Optional[int]:
    """The first step whose value is NaN or infinite, or None."""
    return next((step for step, value in zip(series.steps, series.values) if not math.isfinite(value)), None)


def diverged_at_step(scalars: dict[str, Series]) -> Optional[int]:
    """The first step with a non-finite training or validation loss, or where the non-finite gradient norms that a
    run ended with began (the divergence guard skipped its last updates: a saturated model can keep a finite loss
    while its gradients are NaN); None for a run that did not diverge."""
    steps = [first_non_finite_step(scalars[tag]) for tag in (LOSS, VALIDATION_LOSS) if tag in scalars]
    grad_norms = scalars.get(GRAD_NORM)
    if grad_norms is not None and grad_norms.values and not math.isfinite(grad_norms.values[-1]):
        start = len(grad_norms.values) - 1
        while start > 0 and not math.isfinite(grad_norms.values[start - 1]):
            start -= 1
        steps.append(grad_norms.steps[start])
    return min((step for step in steps if step is not None), default=None)


def summarize(scalars: dict[str, Series], last_k: int) -> dict:
    """One run's numbers; None where the run did not log the tag.

    ``final_loss`` is the mean of the last ``last_k`` logged training losses and ``validation_loss`` the last one
    logged; both are None for a run that diverged (``diverged_at_step`` set).
    """
    loss = scalars.get(LOSS)
    tail = loss.values[-last_k:] if loss else ()
    diverged_at = diverged_at_step(scalars)
    memory_tag = next((t for t in MEMORY_TAGS if t in scalars), None)
    validation = scalars.get(VALIDATION_LOSS)
    return {
        "last_step": loss.steps[-1] if loss else None,
        "final_loss": mean_std(tail)[0] if diverged_at is None else None,
        "final_loss_steps": len(tail),
        "validation_loss": validation.values[-1] if validation and diverged_at is None else None,
        "diverged_at_step": diverged_at,
        "mean_tps": mean_std(scalars[TPS].values)[0] if TPS in scalars else None,
        "peak_memory_gib": max(scalars[memory_tag].values) if memory_tag else None,
        "peak_memory_tag": memory_tag,
        "optimizer_state_bytes": int(round(scalars[STATE_BYTES].values[-1])) if STATE_BYTES in scalars else None,
        "tokens_seen": int(round(scalars[TOKENS_SEEN].values[-1])) if TOKENS_SEEN in scalars else None,
    }


# ----------------------------------------------------------------------------------------------------------------
# A sweep


def sweep_run_summary(run: SweepRun, last_k: int, by_validation: bool) -> dict:
    """A sweep run's spec, outcome and numbers; ``rank_loss`` is what ranks its lr (None unless it finished)."""
    status = run.status
    summary = {
        "name": run.spec.name,
        "optimizer": run.spec.optimizer,
        "lr": run.spec.lr,
        "seed": run.spec.seed,
        "outcome": status["outcome"],
        "exit_code": status["exit_code"],
        "message": status.get("message"),
        **summarize(run.scalars, last_k),
    }
    if status["outcome"] != FINISHED:  # e.g. stopped by the guard (exit 3) before anything non-finite was logged
        summary["final_loss"] = summary["validation_loss"] = None
    summary["rank_loss"] = summary["validation_loss"] if by_validation else summary["final_loss"]
    return summary


def _cell(optimizer: str, lr: float, group: Sequence[dict]) -> dict:
    """One (optimizer, lr) over its seeds: diverged if any seed diverged, else failed if any failed."""
    outcomes = [r["outcome"] for r in group]
    outcome = DIVERGED if DIVERGED in outcomes else FAILED if FAILED in outcomes else FINISHED
    mean, std = mean_std([r["rank_loss"] for r in group if r["outcome"] == FINISHED])
    return {
        "optimizer": optimizer,
        "lr": lr,
        "seeds": sorted(r["seed"] for r in group),
        "outcome": outcome,
        "runs_diverged": outcomes.count(DIVERGED),
        "runs_failed": outcomes.count(FAILED),
        "loss_mean": mean if outcome == FINISHED else None,
        "loss_std": std if outcome == FINISHED else None,
    }


def _best(mine: Sequence[dict], cells: Sequence[dict]) -> dict:
    """An optimizer's best lr (lowest mean among lrs where no seed diverged or failed), speed and memory."""
    candidates = [c for c in cells if c["outcome"] == FINISHED and c["loss_mean"] is not None]
    winner = min(candidates, key=lambda c: c["loss_mean"], default=None)
    completed = [r for r in mine if r["outcome"] == FINISHED]
    tps = [r["mean_tps"] for r in completed if r["mean_tps"] is not None]
    memory = [r["peak_memory_gib"] for r in completed if r["peak_memory_gib"] is not None]
    state = [r["optimizer_state_bytes"] for r in mine if r["optimizer_state_bytes"] is not None]
    return {
        "lr": winner["lr"] if winner else None,
        "loss_mean": winner["loss_mean"] if winner else None,
        "loss_std": winner["loss_std"] if winner else None,
        "seeds": winner["seeds"] if winner else [],
        # Throughput and memory do not depend on the lr: taken over all the optimizer's finished runs.
        "mean_tps": mean_std(tps)[0],
        "min_tps": min(tps, default=None),
        "max_tps": max(tps, default=None),
        "peak_memory_gib": max(memory, default=None),
        "peak_memory_tag": next((r["peak_memory_tag"] for r in mine if r["peak_memory_tag"]), None),
        "optimizer_state_bytes": max(state, default=None),
    }


def summarize_sweep(runs: Sequence[SweepRun], last_k: int) -> dict:
    """Per run, per (optimizer, lr) over seeds, and per optimizer its best lr."""
    finished = [r for r in runs if r.status["outcome"] == FINISHED]
    by_validation = bool(finished) and all(VALIDATION_LOSS in r.scalars for r in finished)
    summaries = [sweep_run_summary(r, last_k, by_validation) for r in runs]
    grid, best = [], {}
    for optimizer in dict.fromkeys(r["optimizer"] for r in summaries):
        mine = [r for r in summaries if r["optimizer"] == optimizer]
        cells = [_cell(optimizer, lr, [r for r in mine if r["lr"] == lr]) for lr in sorted({r["lr"] for r in mine})]
        grid.extend(cells)
        best[optimizer] = _best(mine, cells)
    ranked_by = f"last {VALIDATION_LOSS}" if by_validation else f"mean of the last {last_k} logged training losses"
    return {
        "ranked_by": ranked_by,
        "by_validation": by_validation,
        "last_k": last_k,
        "runs": summaries,
        "grid": grid,
        "best": best,
    }
