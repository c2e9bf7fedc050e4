"""Across model sizes, as pure functions: power laws in the parameter count fitted to what each size's study found
(each optimizer's best settings, its speedup over the baseline, its D_eff / D), their intervals, their value at a
target size, and the next size's lr grid centred on the law's prediction.

A law here is a straight line in log-log: ``log y = intercept + exponent * log N``. Two kinds of fit:

- :func:`fit_log_line` for values measured once per size (a best lr found on a grid): ordinary least squares, the
  exponent's t interval and a prediction interval for a new size from the scatter around the line (n - 2 degrees of
  freedom, so three sizes or more; two sizes give a line but no interval: "underdetermined").
- :func:`fit_trend` for values with their own interval per size (a speedup over confirmation seeds): the same line,
  its interval from a parametric bootstrap that draws each size's value from its own interval (Student's t with the
  size's degrees of freedom) and fits again; where the sizes scatter about the line more than their intervals allow
  (an F test), the bootstrap's spread is widened by that excess (the Birge ratio), so that a law that misfits is
  not reported tighter than its points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from torchtitan.study.statistics import CONFIDENCE, t_quantile

TREND_RESAMPLES = 4000
UNDERDETERMINED = "underdetermined"


@dataclass(frozen=True)
class LogLine:
    """``log y = intercept + exponent * log x`` fitted to ``n`` points by least squares; ``residual_sd`` None with
    two points (the line passes through both: nothing measures its scatter)."""

    exponent: float
    intercept: float
    n: int
    residual_sd: Optional[float]
    x_mean: float  # mean of log x
    sxx: float  # sum of squares of log x about its mean

    def at(self, x: float) -> float:
        return math.exp(self.intercept + self.exponent * math.log(x))

    def exponent_interval(self, confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
        if self.residual_sd is None:
            return None
        half = t_quantile(0.5 + confidence / 2, self.n - 2) * self.residual_sd / math.sqrt(self.sxx)
        return self.exponent - half, self.exponent + half

    def prediction_interval(self, x: float, confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
        """Where a new size's value falls (not only the line's): the t prediction interval, back on the value's
        scale."""
        if self.residual_sd is None:
            return None
        dx = math.log(x) - self.x_mean
        se = self.residual_sd * math.sqrt(1 + 1 / self.n + dx * dx / self.sxx)
        half = t_quantile(0.5 + confidence / 2, self.n - 2) * se
        centre = math.log(self.at(x))
        return math.exp(centre - half), math.exp(centre + half)


def fit_log_line(xs: Sequence[float], ys: Sequence[float], step: float = 1.0) -> Optional[LogLine]:
    """The least-squares line through (log x, log y); None with fewer than two distinct x (or a y not above 0).

    ``step``: the ratio between neighbouring values of the grid each y was found on (1: measured exactly). A value
    found on a grid is the true one rounded to a grid point, off by up to half a step in log: that rounding's
    variance, (log step)^2 / 12 for an error uniform over the step, is added to the scatter about the line, so that
    sizes that all found the same grid point give an interval as wide as the grid leaves it, not one of zero width."""
    if len(xs) != len(ys) or len(set(xs)) < 2 or any(y <= 0 for y in ys) or any(x <= 0 for x in xs):
        return None
    if not step >= 1.0:
        raise ValueError(f"fit_log_line needs a grid step of at least 1 (a ratio of neighbouring values); got {step}")
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    x_mean, sxx = float(lx.mean()), float(((lx - lx.mean()) ** 2).sum())
    exponent = float(((lx - x_mean) * (ly - ly.mean())).sum() / sxx)
    intercept = float(ly.mean() - exponent * x_mean)
    residuals = ly - (intercept + exponent * lx)
    n = len(xs)
    rounding = math.log(step) ** 2 / 12.0
    residual_sd = math.sqrt(float((residuals**2).sum()) / (n - 2) + rounding) if n > 2 else None
    return LogLine(exponent, intercept, n, residual_sd, x_mean, sxx)


# ----------------------------------------------------------------------------------------------------------------
# A trend of values that carry their own intervals


@dataclass(frozen=True)
class TrendPoint:
    """One size's value with its interval at CONFIDENCE: ``df`` the degrees of freedom of its t interval (seeds
    - 1), None for an interval read as normal (a bootstrap's percentiles)."""

    params: float
    value: float
    low: float
    high: float
    df: Optional[float]


@dataclass(frozen=True)
class Trend:
    """``value = at_reference * (N / reference)^exponent`` over ``n`` sizes; the intervals None with fewer than
    three sizes (two points fix a line but nothing bounds how far it is off): ``note`` says so."""

    exponent: float
    exponent_interval: Optional[tuple[float, float]]
    at_target: Optional[float]
    target_interval: Optional[tuple[float, float]]
    n: int
    widened: float  # the Birge ratio applied (1: the sizes scatter no more than their intervals allow)
    note: Optional[str]

    def to_json(self) -> dict:
        return {
            "exponent": self.exponent,
            "exponent_interval": list(self.exponent_interval) if self.exponent_interval else None,
            "at_target": self.at_target,
            "target_interval": list(self.target_interval) if self.target_interval else None,
            "sizes": self.n,
            "widened": self.widened,
            "note": self.note,
        }


def _half_quantile(df: Optional[float], confidence: float) -> float:
    if df is None:
        import scipy.stats

        return float(scipy.stats.norm.ppf(0.5 + confidence / 2))
    return t_quantile(0.5 + confidence / 2, df)


def _excess_scatter(residuals: np.ndarray, se: np.ndarray, dfs: Sequence[Optional[float]], confidence: float) -> float:
    """How much more the sizes scatter about the line than their own intervals say: the square root of the F ratio
    of the residual variance (n - 2 degrees of freedom) to the sizes' mean squared standard error (their seeds'
    degrees of freedom) where an F test finds the excess at 1 - ``confidence``, else 1. (A ratio taken without the
    test would widen most studies of two or three seeds a size: their standard errors are themselves noisy.)"""
    import scipy.stats

    if not (se > 0).all():
        return math.inf
    n = len(residuals)
    ratio = float((residuals**2).sum() / (n - 2)) / float((se**2).mean())
    df_within = sum(df if df is not None else 1000.0 for df in dfs)
    if scipy.stats.f.sf(ratio, n - 2, df_within) >= 1 - confidence:
        return 1.0
    return math.sqrt(ratio)


def fit_trend(
    points: Sequence[TrendPoint],
    target: Optional[float] = None,
    confidence: float = CONFIDENCE,
    resamples: int = TREND_RESAMPLES,
    seed: int = 0,
) -> Optional[Trend]:
    """The power law of ``points`` against parameters, its exponent's interval and its value at ``target`` (module
    docstring). None with fewer than two sizes. Seeded: a report rebuilt says the same."""
    by_size = sorted(points, key=lambda p: p.params)
    if len({p.params for p in by_size}) < 2:
        return None
    line = fit_log_line([p.params for p in by_size], [p.value for p in by_size])
    at_target = line.at(target) if target else None
    n = len(by_size)
    if n < 3:
        return Trend(
            line.exponent,
            None,
            at_target,
            None,
            n,
            1.0,
            f"{UNDERDETERMINED}: two sizes fix a line but cannot bound it (a third size gives an interval)",
        )
    lx = np.log(np.asarray([p.params for p in by_size], float))
    ly = np.log(np.asarray([p.value for p in by_size], float))
    se = np.asarray(
        [(math.log(p.high) - math.log(p.low)) / (2 * _half_quantile(p.df, confidence)) for p in by_size], float
    )
    residuals = ly - (line.intercept + line.exponent * lx)
    widened = _excess_scatter(residuals, se, [p.df for p in by_size], confidence)
    rng = np.random.default_rng(seed)
    draws = np.stack(
        [rng.standard_t(p.df, resamples) if p.df is not None else rng.standard_normal(resamples) for p in by_size],
        axis=1,
    )
    ys = ly + draws * se  # (resamples, sizes)
    xc = lx - lx.mean()
    slopes = (ys - ys.mean(axis=1, keepdims=True)) @ xc / float((xc**2).sum())
    tail = (1 - confidence) / 2

    def interval(samples: np.ndarray, centre: float) -> tuple[float, float]:
        low, high = np.quantile(samples, [tail, 1 - tail], method="inverted_cdf")
        return centre + widened * (float(low) - centre), centre + widened * (float(high) - centre)

    if not math.isfinite(widened):
        return Trend(line.exponent, None, at_target, None, n, widened, "a size has no spread over its seeds")
    exponent_interval = interval(slopes, line.exponent)
    target_interval = None
    if target:
        at = ys.mean(axis=1) + slopes * (math.log(target) - lx.mean())
        low, high = interval(at, math.log(at_target))
        target_interval = (math.exp(low), math.exp(high))
    note = None if widened == 1.0 else f"widened {widened:.2f}× (the sizes scatter more than their intervals allow)"
    return Trend(line.exponent, exponent_interval, at_target, target_interval, n, widened, note)


@dataclass(frozen=True)
class Saturating:
    """``value = 1 + sign * a * N^b`` (``sign`` +1 for speedups above 1, -1 below): a speedup that may bend
    toward 1 with size, fitted beside the power law; its value at the target and a bootstrap interval (resamples
    whose sizes cross 1 fit no such law and are counted as unknown at both ends)."""

    exponent: float
    at_target: float
    target_interval: tuple[float, float]
    failed: int
    resamples: int

    def to_json(self) -> dict:
        return {
            "exponent": self.exponent,
            "at_target": self.at_target,
            "target_interval": list(self.target_interval),
            "failed": self.failed,
            "resamples": self.resamples,
        }


def fit_saturating(
    points: Sequence[TrendPoint],
    target: float,
    confidence: float = CONFIDENCE,
    resamples: int = TREND_RESAMPLES,
    seed: int = 0,
) -> Optional[Saturating]:
    """The saturating alternative to :func:`fit_trend`'s power law: log |value - 1| a straight line in log N, the
    sizes drawn from their own intervals as :func:`fit_trend` draws them. None with fewer than three sizes or where
    the sizes' values do not all lie on one side of 1 (no such law passes through them)."""
    from torchtitan.study.statistics import percentile_interval

    by_size = sorted(points, key=lambda p: p.params)
    if len({p.params for p in by_size}) < 3:
        return None
    values = np.asarray([p.value for p in by_size], float)
    sign = 1.0 if (values > 1).all() else -1.0 if (values < 1).all() else 0.0
    if sign == 0.0:
        return None
    params = [p.params for p in by_size]
    line = fit_log_line(params, list(sign * (values - 1.0)))
    lx = np.log(np.asarray(params, float))
    se = np.asarray(
        [(math.log(p.high) - math.log(p.low)) / (2 * _half_quantile(p.df, confidence)) for p in by_size], float
    )
    rng = np.random.default_rng(seed)
    draws = np.stack(
        [rng.standard_t(p.df, resamples) if p.df is not None else rng.standard_normal(resamples) for p in by_size],
        axis=1,
    )
    excess = sign * (np.exp(np.log(values) + draws * se) - 1.0)  # (resamples, sizes)
    ok = (excess > 0).all(axis=1)
    ly = np.log(excess[ok])
    xc = lx - lx.mean()
    slopes = (ly - ly.mean(axis=1, keepdims=True)) @ xc / float((xc**2).sum())
    at = 1.0 + sign * np.exp(ly.mean(axis=1) + slopes * (math.log(target) - lx.mean()))
    failed = int(resamples - ok.sum())
    low, high = percentile_interval(at, failed, confidence)
    return Saturating(line.exponent, 1.0 + sign * line.at(target), (low, high), failed, resamples)


def determined(power: Optional[tuple[float, float]], saturating: Optional[tuple[float, float]]) -> bool:
    """Whether the two laws' intervals at the target overlap: where they do not, the sizes trained fit both and
    the target's value depends on which law holds past them."""
    if power is None or saturating is None:
        return True
    return power[0] <= saturating[1] and saturating[0] <= power[1]


# ----------------------------------------------------------------------------------------------------------------
# Settings carried up


def significant(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def carried_grid(lrs: Sequence[float], prediction: float) -> list[float]:
    """The grid of ``lrs`` moved to centre on ``prediction``: the same ratios between values, its geometric centre
    at the prediction; each value rounded to three significant digits (a run's name holds it)."""
    centre = math.exp(sum(math.log(lr) for lr in lrs) / len(lrs))
    grid = sorted({significant(prediction * lr / centre) for lr in lrs})
    return grid


def predicted_against_found(sizes: Sequence[tuple[str, float, Optional[float]]], step: float = 1.0) -> list[dict]:
    """For every size after the first two (by parameters): the law fitted to the smaller sizes' found values, its
    prediction for this size with a prediction interval (three or more smaller sizes), and what was found.
    ``sizes`` = (name, parameters, found value or None); ``step`` the grid's (:func:`fit_log_line`): a found value
    is inside when it lies within half a step of the interval (the grid point nearest a value inside it)."""
    ordered = sorted(sizes, key=lambda s: s[1])
    rows = []
    for i, (name, params, found) in enumerate(ordered):
        if i < 2:
            continue
        known = [(p, v) for _, p, v in ordered[:i] if v is not None]
        line = fit_log_line([p for p, _ in known], [v for _, v in known], step) if len(known) >= 2 else None
        interval = line.prediction_interval(params) if line else None
        half = math.sqrt(step)
        rows.append(
            {
                "size": name,
                "params": params,
                "from_sizes": len(known),
                "predicted": line.at(params) if line else None,
                "interval": list(interval) if interval else None,
                "found": found,
                "inside": None
                if interval is None or found is None
                else interval[0] / half <= found <= interval[1] * half,
            }
        )
    return rows
