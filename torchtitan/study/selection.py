"""Choosing each optimizer's best settings from its selection runs: a curve fitted over the grid, not the single
lowest cell.

The lowest of a few noisy cells is often a neighbour of the true best by luck (one selection seed, a 5-point lr
grid, noise a little below the cost of one grid step: the lowest run is the true best in about 72% of studies).
The losses near the lowest cell say more together: along each numeric setting (the lr first) the selection losses
are fitted by a quadratic in the log of the lr (other settings: in the value itself, :func:`scale_of`) over the
lowest cell and up to :data:`NEIGHBOURS` finished values on each side, pooled over the selection seeds (each seed
an offset of its own, shared by all its runs), and the value chosen is the grid value nearest the fitted optimum,
i.e. the one the fitted curve puts lowest. The assumption: the loss is smooth in log lr near its optimum.

It falls back to the lowest cell, and says so, where fewer than three finished values lie near it or the fit is not
a bowl (a hill or a line). Settings that are words (categorical) keep the lowest cell's value. How sure the choice
is: the margin between the chosen value and the runner-up (the next lowest by the same rule) against its standard
error, from the fit's residuals (or, for the lowest cell, from the spread of the runs about their cell and seed
means); a margin under :data:`CLOSE_CALL` standard errors is within the noise, and the words say so.

Pure functions of losses (numpy, no torch): ``summary.summarize_sweep`` chooses every optimizer's best settings
with :func:`choose_settings`, and the coordinate descent (``search.descend``) moves along each setting with
:func:`choose_along`, so that both follow one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

NEIGHBOURS = 2  # finished values on each side of the lowest cell that the quadratic is fitted over
CLOSE_CALL = 2.0  # a margin under this many standard errors is within the noise
FIT, BEST_CELL = "fit", "best cell"
TOO_FEW = "fewer than three finished values near the lowest cell"
NOT_CONVEX = "the fitted curve is not a bowl (a hill or a line)"
LOG, LINEAR = "log", "linear"
FAR = 50.0  # a fitted optimum further than this (in log for the lr) from the lowest cell is shown as none

Losses = Optional[Mapping[int, float]]  # a cell's loss per selection seed; None where it did not finish


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scale_of(key: str) -> str:
    """The lr is fitted in its log (grids of lrs are geometric, and the loss is smooth in log lr near its optimum);
    other numeric settings as they are (a weight decay grid often holds 0, which has no log). One rule for the
    descent and the report, whatever values either has seen."""
    return LOG if key == "lr" else LINEAR


@dataclass(frozen=True)
class LineChoice:
    """The choice along one setting: the chosen index into ``values`` (None where no value finished), how
    (``method``: "fit" or "best cell", with ``fallback`` saying why not the fit), the fitted curve (``curve``:
    loss = a + b u + c u² in u = x - ``centre``, x the value or its log by ``scale``; ``optimum`` the value at its
    lowest point), the runner-up, the margin between them and its standard error (``noise``: None where nothing
    estimates it)."""

    values: tuple[float, ...]
    means: tuple[Optional[float], ...]
    index: Optional[int]
    lowest: Optional[int]  # the lowest cell's index
    method: str = BEST_CELL
    fallback: Optional[str] = None
    scale: str = LOG
    curve: Optional[tuple[float, float, float, float]] = None  # (a, b, c, centre)
    optimum: Optional[float] = None  # None also where it lies far past the grid (:data:`FAR`)
    fitted: tuple[int, ...] = ()  # the indices the curve was fitted over
    runner_up: Optional[int] = None
    margin: Optional[float] = None
    noise: Optional[float] = None
    residual_dof: int = 0

    @property
    def close(self) -> Optional[bool]:
        """Whether the margin is within the noise (None where the noise is unknown or there is no runner-up)."""
        if self.margin is None or self.noise is None:
            return None
        return self.margin < CLOSE_CALL * self.noise

    def to_json(self, key: str) -> dict:
        chosen = None if self.index is None else self.values[self.index]
        return {
            "setting": key,
            "values": list(self.values),
            "means": list(self.means),
            "chosen": chosen,
            "lowest": None if self.lowest is None else self.values[self.lowest],
            "method": self.method,
            "fallback": self.fallback,
            "scale": self.scale,
            "curve": None if self.curve is None else dict(zip(("a", "b", "c", "centre"), self.curve)),
            "optimum": self.optimum,
            "fitted": [self.values[i] for i in self.fitted],
            "runner_up": None if self.runner_up is None else self.values[self.runner_up],
            "margin": self.margin,
            "noise": self.noise,
            "close": self.close,
        }


def _x(value: float, scale: str) -> float:
    return math.log(value) if scale == LOG else float(value)


def _observations(indices: Sequence[int], losses: Sequence[Losses]) -> tuple[list[int], list[int], list[float]]:
    """(index, seed, loss) of every run of the cells at ``indices``, as three lists."""
    rows = [(i, seed, loss) for i in indices for seed, loss in sorted((losses[i] or {}).items())]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _least_squares(
    columns: list[np.ndarray], y: np.ndarray, weights: Optional[np.ndarray] = None
) -> tuple[np.ndarray, np.ndarray, float, int]:
    """(coefficients, their covariance per unit of residual variance, the residual variance (nan without residual
    degrees of freedom), residual degrees of freedom) of the (weighted) least squares of y over the columns."""
    x = np.column_stack(columns)
    w = np.ones(len(y)) if weights is None else weights
    root = np.sqrt(w)
    coefficients, *_ = np.linalg.lstsq(x * root[:, None], y * root, rcond=None)
    dof = len(y) - int(np.linalg.matrix_rank(x))
    bread = np.linalg.pinv(x.T @ (x * w[:, None]))
    covariance = bread @ (x.T @ (x * (w * w)[:, None])) @ bread  # weights that are not 1 / variance: the sandwich
    hat = float(np.trace(x @ bread @ (x * w[:, None]).T))
    residual = y - x @ coefficients
    variance = float(residual @ residual) / (len(y) - hat) if dof > 0 else math.nan
    return coefficients, covariance, variance, dof


def _seed_columns(seeds: Sequence[int]) -> list[np.ndarray]:
    array = np.array(seeds)
    return [(array == s).astype(float) for s in sorted(set(seeds))]


def cell_noise(indices: Sequence[int], losses: Sequence[Losses]) -> tuple[float, int]:
    """The variance of one run about its cell's mean and its seed's offset (the two-way additive model over the
    cells at ``indices``), and its degrees of freedom: the seeds' spread with what all a seed's runs share taken
    out. Variance nan without degrees of freedom."""
    cells, seeds, y = _observations(indices, losses)
    if not y:
        return math.nan, 0
    columns = [(np.array(cells) == i).astype(float) for i in sorted(set(cells))] + _seed_columns(seeds)
    _, _, variance, dof = _least_squares(columns, np.array(y))
    return variance, dof


def _mean(losses: Losses) -> Optional[float]:
    if not losses or not all(math.isfinite(v) for v in losses.values()):
        return None
    return sum(losses.values()) / len(losses)


def choose_along(
    values: Sequence[float],
    losses: Sequence[Losses],
    numeric: bool = True,
    prefer: Optional[int] = None,
    scale: str = LOG,
) -> LineChoice:
    """The choice among ``values`` (one setting's values in ascending order, the others fixed) from each value's
    per-seed losses (None, or any non-finite loss: not finished, never chosen). ``numeric`` False (words): the
    lowest cell. ``prefer``: the index kept where cells tie (a descent stays where it is). ``scale``: the
    setting's (:func:`scale_of`)."""
    values = tuple(values)
    means = tuple(_mean(x) for x in losses)
    finished = [i for i, m in enumerate(means) if m is not None]
    scale = scale if numeric else LINEAR
    if not finished:
        return LineChoice(values, means, None, None, scale=scale)
    lowest = min(finished, key=lambda i: (means[i], i != prefer))
    if not numeric:
        return _lowest_cell(values, means, losses, finished, lowest, None, scale)
    at = finished.index(lowest)
    near = finished[max(0, at - NEIGHBOURS) : at + NEIGHBOURS + 1]
    if len(near) < 3:
        return _lowest_cell(values, means, losses, finished, lowest, TOO_FEW, scale)
    centre = _x(values[lowest], scale)
    cells, seeds, y = _observations(near, losses)
    u = np.array([_x(values[i], scale) - centre for i in cells])
    # Tricube weights by grid steps from the lowest cell: the nearest values count most, so that a bowl steeper on
    # one side bends the fit less (the quadratic holds near the optimum, not across the grid).
    steps = np.array([abs(near.index(i) - near.index(lowest)) for i in cells], dtype=float)
    weights = (1.0 - (steps / (NEIGHBOURS + 1)) ** 3) ** 3
    coefficients, covariance, variance, dof = _least_squares([u, u**2, *_seed_columns(seeds)], np.array(y), weights)
    b, c = float(coefficients[0]), float(coefficients[1])
    spread = max(abs(_x(values[near[-1]], scale) - _x(values[near[0]], scale)), 1e-300)
    if not c * spread**2 > 1e-12 * max(1.0, max(abs(v) for v in y)):
        return _lowest_cell(values, means, losses, finished, lowest, NOT_CONVEX, scale, (variance, dof))
    level = float(np.average(np.array(y) - b * u - c * u**2, weights=weights))  # the curve of the average seed

    def fitted(i: int) -> float:
        d = _x(values[i], scale) - centre
        return b * d + c * d * d

    order = sorted(near, key=lambda i: (fitted(i), i != prefer))
    index, runner_up = order[0], order[1]
    margin = fitted(runner_up) - fitted(index)
    noise = None
    if dof > 0:
        du = _x(values[runner_up], scale) - centre, _x(values[index], scale) - centre
        contrast = np.zeros(len(coefficients))
        contrast[0], contrast[1] = du[0] - du[1], du[0] ** 2 - du[1] ** 2
        noise = math.sqrt(max(0.0, variance * float(contrast @ covariance @ contrast)))
    optimum_x = centre - b / (2.0 * c)
    if scale == LOG:  # a nearly flat bowl can put its optimum past any float: none then, the page says far past
        optimum = math.exp(optimum_x) if abs(optimum_x - centre) < FAR else None
    else:
        optimum = optimum_x if abs(optimum_x - centre) < FAR * max(1.0, abs(centre)) else None
    return LineChoice(
        values,
        means,
        index,
        lowest,
        FIT,
        None,
        scale,
        (level, b, c, centre),
        optimum,
        tuple(near),
        runner_up,
        margin,
        noise,
        dof,
    )


def _lowest_cell(
    values: tuple,
    means: tuple,
    losses: Sequence[Losses],
    finished: list[int],
    lowest: int,
    fallback: Optional[str],
    scale: str,
    fit_noise: Optional[tuple[float, int]] = None,
) -> LineChoice:
    """The lowest cell, its runner-up (the next lowest) and the margin's standard error from the fit's residuals
    where the fit had some, else from the runs' spread about their cell and seed means."""
    rest = sorted((i for i in finished if i != lowest), key=lambda i: means[i])
    runner_up = rest[0] if rest else None
    margin = noise = None
    dof = 0
    if runner_up is not None:
        margin = means[runner_up] - means[lowest]
        variance, dof = fit_noise if fit_noise is not None and fit_noise[1] > 0 else cell_noise(finished, losses)
        if dof > 0:
            n_lowest, n_runner_up = len(losses[lowest] or {}), len(losses[runner_up] or {})
            noise = math.sqrt(variance * (1.0 / n_lowest + 1.0 / n_runner_up))
    return LineChoice(
        values,
        means,
        lowest,
        lowest,
        BEST_CELL,
        fallback,
        scale,
        runner_up=runner_up,
        margin=margin,
        noise=noise,
        residual_dof=dof,
    )


# ----------------------------------------------------------------------------------------------------------------
# Every setting of a grid


@dataclass(frozen=True)
class Choice:
    """An optimizer's chosen settings, the lowest cell's, and the choice along each setting that took more than
    one value (lr first), from the last pass."""

    settings: dict
    lowest: dict
    lines: dict[str, LineChoice]

    def to_json(self) -> dict:
        return {
            "settings": self.settings,
            "lowest": self.lowest,
            "lines": [line.to_json(key) for key, line in self.lines.items()],
        }


def setting_order(keys) -> list[str]:
    """The lr first, then the options by name."""
    return sorted(keys, key=lambda k: (k != "lr", k))


def _key(settings: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def choose_settings(cells: Sequence[tuple[dict, Losses]], max_passes: int = 10) -> Optional[Choice]:
    """The settings chosen among ``cells`` ((settings, per-seed losses or None) of one optimizer at one budget):
    from the lowest cell, along each setting in turn (lr first) the value :func:`choose_along` picks among the cells
    that differ from the current point in that setting only, until a pass over every setting moves nowhere. None
    where no cell finished."""
    by_key = {_key(s): (s, losses) for s, losses in cells}
    finished = [(s, _mean(losses)) for s, losses in cells if _mean(losses) is not None]
    if not finished:
        return None
    lowest = min(finished, key=lambda sm: sm[1])[0]
    keys = setting_order(lowest)
    numeric = {k: all(is_number(s.get(k)) for s, _ in cells) for k in keys}
    current, lines = dict(lowest), {}
    for _ in range(max_passes):
        moved = False
        for key in keys:
            line = [s for s, _ in cells if all(s.get(k) == v for k, v in current.items() if k != key)]
            if len({repr(s[key]) for s in line}) < 2:
                continue
            line.sort(key=lambda s: s[key] if numeric[key] else str(s[key]))
            values = [s[key] for s in line]
            here = next(i for i, s in enumerate(line) if _key(s) == _key(current))
            losses = [by_key[_key(s)][1] for s in line]
            choice = choose_along(values, losses, numeric[key], here, scale_of(key))
            lines[key] = choice
            if choice.index is not None and choice.index != here:
                current, moved = dict(line[choice.index]), True
        if not moved:
            break
    return Choice(current, dict(lowest), {k: lines[k] for k in keys if k in lines})


# ----------------------------------------------------------------------------------------------------------------
# In words


def _value(key: str, value) -> str:
    from torchtitan.study.plan import lr_label

    return lr_label(value) if key == "lr" and is_number(value) else f"{value:.4g}" if is_number(value) else str(value)


def line_text(line: dict) -> str:
    """How sure one setting's choice is, in words (``line``: :meth:`LineChoice.to_json`)."""
    key = line["setting"]
    if line["chosen"] is None:
        return f"{key}: no value finished"
    chosen = _value(key, line["chosen"])
    if line["method"] == FIT:
        optimum = "far past the grid" if line["optimum"] is None else f"{line['optimum']:.3g}"
        how = (
            f"{key} {chosen}: nearest the optimum ({optimum}) of a quadratic in "
            f"{'log ' if line['scale'] == LOG else ''}{key} over {len(line['fitted'])} values"
        )
        if line["lowest"] != line["chosen"]:
            how += f" (the lowest cell was {_value(key, line['lowest'])})"
    elif line["fallback"] is not None:
        how = f"{key} {chosen}: the lowest cell ({line['fallback']})"
    else:
        how = f"{key} {chosen}: the lowest cell"
    if line["runner_up"] is None:
        return how
    beats = f"beats {_value(key, line['runner_up'])} by {line['margin']:.4f}"
    if line["noise"] is None:
        return f"{how}; {beats}, noise unknown (no residual left to measure it: more seeds or values would)"
    if line["close"]:
        return (
            f"{how}; {beats}, within the noise (s.e. {line['noise']:.4f}): a close call, "
            f"{_value(key, line['runner_up'])} may be as good"
        )
    return f"{how}; {beats}, {line['margin'] / line['noise']:.1f} s.e."


def choice_text(choice: Optional[dict]) -> str:
    """How sure an optimizer's choice of settings is (``choice``: :meth:`Choice.to_json`), every setting that took
    more than one value; "n/a" where nothing finished."""
    if not choice:
        return "n/a"
    lines = choice["lines"]
    return "; ".join(line_text(line) for line in lines) if lines else "one setting tried"
