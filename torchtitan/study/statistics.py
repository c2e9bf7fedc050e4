"""The study's statistics: Student's t, the paired or Welch's interval for a difference of means, tokens to reach a
loss along a curve, speedup at matched loss, and the power-law fit of loss against tokens with a bootstrap interval.

Pure functions of numbers (t quantiles from scipy.stats, the bootstrap with numpy, no torch), so the report is the
same wherever it is rebuilt and each function is tested on made-up values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

CONFIDENCE = 0.95
BETTER, WORSE, NO_DIFFERENCE = "better", "worse", "no detectable difference"


# ----------------------------------------------------------------------------------------------------------------
# Student's t distribution (scipy.stats)


@functools.lru_cache(maxsize=4096)  # a report asks for the same few quantiles many times
def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0 < p < 1) for Student's t with ``df`` (> 0, not necessarily whole) degrees of
    freedom."""
    import scipy.stats  # here: the study's modules load without it (a Slurm job's callbacks import them)

    if not (0.0 < p < 1.0) or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0; got p={p}, df={df}")
    return float(scipy.stats.t.ppf(p, df))


# ----------------------------------------------------------------------------------------------------------------
# Means over seeds and differences between them


def require_finite(what: str, values: Sequence[float]) -> None:
    """A NaN or infinite number reaching a statistic is a bug of its caller (the report leaves such values out and
    says so): refused, rather than turned into a NaN interval or a reversed order."""
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{what} needs finite numbers; got {list(values)}")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def sample_variance(values: Sequence[float]) -> float:
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / (len(values) - 1)


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> Optional[float]:
    """Half-width of the t confidence interval of the mean; None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    return t_quantile(0.5 + confidence / 2.0, n - 1) * math.sqrt(sample_variance(values) / n)


PAIRED, WELCH = "paired", "Welch"
NO_SPREAD = "no verdict: the seeds varied nothing"


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) with its confidence interval: ``method`` "paired" (the t interval of per-seed differences,
    for runs that share their seeds) or "Welch" (unequal variances, Welch–Satterthwaite df).

    When a side's seeds (or, paired, the per-seed differences) all gave the same value there is no spread to judge a
    difference by: ``low``, ``high``, ``df`` and ``p_value`` are None and the verdict is :data:`NO_SPREAD` (a zero
    width interval would call 1e-7 "better")."""

    difference: float
    low: Optional[float]
    high: Optional[float]
    df: Optional[float]
    n_a: int
    n_b: int
    method: str = WELCH
    p_value: Optional[float] = None  # two-sided, of "no difference", from the same t distribution as the interval

    @property
    def verdict(self) -> str:
        """For losses (lower is better): a is better when the whole interval is below 0, worse when above."""
        if self.low is None or self.high is None:
            return NO_SPREAD
        return verdict_of(self.low, self.high)


def verdict_of(low: float, high: float) -> str:
    if high < 0:
        return BETTER
    if low > 0:
        return WORSE
    return NO_DIFFERENCE


# The resolution of a stored loss: the trainer logs float32 losses (and event files keep float32), whose values a
# few units of the last place apart are the same loss rounded differently, not seeds that varied.
STORED_RESOLUTION = 4 * 2.0**-23


def varied_nothing(values: Sequence[float], scale: Sequence[float] = ()) -> bool:
    """Whether ``values`` are all the same at the resolution of a stored (float32) loss: their spread at most
    :data:`STORED_RESOLUTION` of the largest magnitude among them and ``scale``. Seeds that changed nothing, so no
    spread to judge a difference by."""
    largest = max((abs(v) for v in (*values, *scale)), default=0.0)
    return max(values) - min(values) <= STORED_RESOLUTION * largest


def _t_p_value(statistic: float, df: float) -> float:
    """Two-sided p of a t statistic with ``df`` degrees of freedom."""
    import scipy.stats

    return float(2.0 * scipy.stats.t.sf(abs(statistic), df))


def welch_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Optional[Difference]:
    """Welch's t interval of mean(a) - mean(b); None unless both sides have at least two values."""
    require_finite("welch_difference", [*a, *b])
    if len(a) < 2 or len(b) < 2:
        return None
    difference = mean(a) - mean(b)
    va, vb = sample_variance(a) / len(a), sample_variance(b) / len(b)
    if varied_nothing(a) or varied_nothing(b):  # a side whose seeds varied nothing: no estimate of the noise
        return Difference(difference, None, None, None, len(a), len(b))
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * se
    p = _t_p_value(difference / se, df)
    return Difference(difference, difference - half, difference + half, df, len(a), len(b), WELCH, p)


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Optional[Difference]:
    """The paired t interval of mean(a - b) over pairs (a[i], b[i]) that ran the same seed (the same initial
    weights and data order); None for fewer than two pairs."""
    if len(a) != len(b):
        raise ValueError("paired_difference needs as many values on each side, one pair per seed")
    require_finite("paired_difference", [*a, *b])
    if len(a) < 2:
        return None
    differences = [x - y for x, y in zip(a, b)]
    centre, n = mean(differences), len(differences)
    se = math.sqrt(sample_variance(differences) / n)
    if varied_nothing(a) or varied_nothing(b) or varied_nothing(differences, (*a, *b)):
        return Difference(centre, None, None, None, n, n, PAIRED)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * se
    return Difference(centre, centre - half, centre + half, n - 1, n, n, PAIRED, _t_p_value(centre / se, n - 1))


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (each compared with the family's level, e.g. 0.05): the smallest p times
    the family's size m, the next times m - 1, ..., each at least the one before and at most 1. Rejecting where the
    adjusted p is below the level keeps the chance of any false rejection in the family at that level, whatever the
    dependence between the tests."""
    require_finite("holm_adjusted", p_values)
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# ----------------------------------------------------------------------------------------------------------------
# Speedup at matched loss


def trailing_mean(values: Sequence[float], k: int) -> list[float]:
    """At each point, the mean of it and the k - 1 before it (fewer at the start): the final training loss of a
    run, mean of its last k logged values, is the last point of this curve."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


@dataclass(frozen=True)
class Reach:
    """Where a curve first gets down to a loss: ``tokens`` interpolated between the two logged points around it.

    ``bound`` is None for a crossing inside the curve, ">" when the curve never gets there (``tokens`` is then its
    last point: the tokens needed are more), "<" when its first point is already there (``tokens`` is that point).
    """

    tokens: float
    bound: Optional[str]


def tokens_to_reach(tokens: Sequence[float], losses: Sequence[float], target: float) -> Reach:
    """The first place where the curve (tokens increasing) is at or below ``target``, linear between points."""
    if not tokens or len(tokens) != len(losses):
        raise ValueError("tokens_to_reach needs a curve of at least one point, as many tokens as losses")
    if losses[0] <= target:
        return Reach(float(tokens[0]), "<" if losses[0] < target else None)
    for i in range(1, len(tokens)):
        if losses[i] <= target:
            fraction = (losses[i - 1] - target) / (losses[i - 1] - losses[i])
            return Reach(tokens[i - 1] + fraction * (tokens[i] - tokens[i - 1]), None)
    return Reach(float(tokens[-1]), ">")


AT_LEAST, AT_MOST, MIXED = "≥", "≤", "mixed"


@dataclass(frozen=True)
class Speedup:
    """D_eff / D: the tokens the baseline needs to reach a loss over the tokens the run used to reach it.

    ``bound`` None: ``value`` is the geometric mean of exact per-seed ratios, ``low`` and ``high`` its t interval
    at ``level`` (None with one seed). "≥": some seed's ratio is a lower bound (neither curve got to the other's
    loss) and no seed's an upper one; ``value`` is then the smallest per-seed figure, a one-sided bound on the
    median per-seed speedup at ``level`` = 1 - 2^-n for n independent seeds (the chance that n figures, each at or
    below its seed's speedup, all lie above that median is at most 2^-n): 87.5% for 3 seeds, 96.9% for 5. "≤"
    the same upwards. "mixed": some seeds bound it from below and others from above, and no figure holds for every
    seed (``value`` None). ``per_seed`` keeps each seed's (ratio, bound) with the bound in :class:`Reach`'s terms.
    """

    value: Optional[float]
    bound: Optional[str]
    low: Optional[float]
    high: Optional[float]
    seeds: int
    per_seed: tuple[tuple[float, Optional[str]], ...] = ()
    level: Optional[float] = None


def order_bound_level(independent: int) -> float:
    """The level of the smallest (or largest) of ``independent`` figures as a one-sided bound on their median."""
    return 1.0 - 0.5**independent


def combine_speedups(
    per_seed: Sequence[tuple[float, Optional[str]]], confidence: float = CONFIDENCE, independent: Optional[int] = None
) -> Speedup:
    """One figure from per-seed (ratio, bound) pairs: the bound a :class:`Reach` gave (">": at least the ratio,
    "<": at most it, None: exact). See :class:`Speedup` for what each case gives; ``independent``: how many of the
    figures are independent draws (all of them unless given), which sets a bound's level."""
    if not per_seed:
        raise ValueError("combine_speedups needs at least one seed")
    require_finite("combine_speedups", [r for r, _ in per_seed])
    ratios = [r for r, _ in per_seed]
    bounds = {b for _, b in per_seed}
    n, kept = len(per_seed), tuple(per_seed)
    level = order_bound_level(n if independent is None else independent)
    if ">" in bounds and "<" in bounds:
        return Speedup(None, MIXED, None, None, n, kept)
    if ">" in bounds:  # every seed's speedup is at least its ratio (exact ones: equal to it)
        return Speedup(min(ratios), AT_LEAST, None, None, n, kept, level)
    if "<" in bounds:
        return Speedup(max(ratios), AT_MOST, None, None, n, kept, level)
    logs = [math.log(r) for r in ratios]
    centre = mean(logs)
    half = mean_ci(logs, confidence)
    if half is None:
        return Speedup(math.exp(centre), None, None, None, n, kept)
    return Speedup(math.exp(centre), None, math.exp(centre - half), math.exp(centre + half), n, kept, confidence)


Window = Sequence[float]  # the tokens of the logged points a run's final loss averages (one for a validation loss)


def matched_ratio(tokens: Sequence[float], losses: Sequence[float], window: Window, target: float) -> tuple:
    """(D_eff / D, bound): the scale c at which the baseline's raw curve (tokens, losses), read at the run's own
    window points each times c (linear between its logged points), averages to ``target``, the run's final loss
    (the mean of its losses at ``window``). The first such c from the smallest the curve allows (its window's first
    point at the curve's first) to the largest (its window's last point at the curve's last); bound "<" when the
    curve is already there at the smallest (an upper bound), ">" when it never gets there (a lower bound).

    Scaling the window with c is what makes a trailing mean unbiased: a run that trains s times as fast has, over
    its last k points, the loss the baseline has over those points' tokens times s, a window s times as wide (a
    window of fixed width reads a faster run's smoothed loss against the baseline's narrower one)."""
    if not tokens or len(tokens) != len(losses) or not window:
        raise ValueError("matched_ratio needs a curve of at least one point and a window of at least one point")
    curve_t, curve_l = np.asarray(tokens, dtype=float), np.asarray(losses, dtype=float)
    at = np.asarray(window, dtype=float)
    low, high = curve_t[0] / at[0], curve_t[-1] / at[-1]
    if high < low:  # the run's window is wider, relatively, than the baseline's whole curve: never matched
        return float(high), ">"
    # The mean is linear in c between the scales where one of the window's points meets one of the curve's.
    scales = curve_t[None, :] / at[:, None]
    scales = np.unique(np.concatenate([[low, high], scales[(scales > low) & (scales < high)]]))
    means = np.interp(scales[:, None] * at[None, :], curve_t, curve_l).mean(axis=1)
    there = np.flatnonzero(means <= target)
    if there.size == 0:
        return float(high), ">"
    i = int(there[0])
    if i == 0:
        return float(low), "<" if means[0] < target else None
    fraction = (means[i - 1] - target) / (means[i - 1] - means[i])
    return float(scales[i - 1] + fraction * (scales[i] - scales[i - 1])), None


def _window(used) -> list[float]:
    return [float(used)] if isinstance(used, (int, float)) else [float(t) for t in used]


Curve = tuple[Sequence[float], Sequence[float]]  # (tokens, raw losses) as logged
Final = tuple[float, object]  # (final loss, the tokens used or the window of tokens it averages)


def two_way_ratio(base_curve: Curve, run_final: Final, run_curve: Optional[Curve], base_final: Optional[Final]):
    """(D_eff / D, bound) of one run against one baseline run, read along whichever curve reaches the other's final
    loss. First the baseline's curve at the run's final loss (:func:`matched_ratio`); where it never gets there
    (the run is ahead when the baseline's curve ends, as at the same budget always for a faster run) the run's own
    curve at the baseline's final loss instead: the scale c at which the run's curve, read at the baseline's window
    times c, averages to it, a speedup of 1 / c. Under "the run's loss at D is the baseline's at s D" both read s,
    so the end of the baseline's curve is no ceiling; a bound remains only where neither curve reaches the other."""
    (tokens, losses), (loss, used) = base_curve, run_final
    ratio, bound = matched_ratio(tokens, losses, _window(used), loss)
    if bound != ">" or run_curve is None or base_final is None:
        return ratio, bound
    (run_tokens, run_losses), (base_loss, base_used) = run_curve, base_final
    scale, back = matched_ratio(run_tokens, run_losses, _window(base_used), base_loss)
    if back == ">":  # the run's curve never got to the baseline's loss either: the first bound stands
        return ratio, bound
    return 1.0 / scale, None if back is None else ">"  # "<": already there at its smallest scale, a lower bound


def speedup_at_matched_loss(
    baseline_curves: Sequence[Curve],
    finals: Sequence[Final],
    confidence: float = CONFIDENCE,
    run_curves: Optional[Sequence[Curve]] = None,
    baseline_finals: Optional[Sequence[Final]] = None,
) -> Speedup:
    """Paired speedup over seeds: ``finals[i]`` = (final loss, tokens used, or the window of tokens its final loss
    averages) of seed i, matched against ``baseline_curves[i]`` = (tokens, raw losses) of the same seed of the
    baseline; with the run's own curves and the baseline's finals, read either way (:func:`two_way_ratio`).

    Exact per-seed speedups give their geometric mean and the t interval of their logarithms (a ratio's spread is
    symmetric on a log scale); bounds among them give a one-sided bound at its level (:func:`combine_speedups`).
    """
    if not finals or len(finals) != len(baseline_curves):
        raise ValueError("speedup_at_matched_loss needs one baseline curve per seed")
    runs = run_curves or [None] * len(finals)
    bases = baseline_finals or [None] * len(finals)
    per_seed = [two_way_ratio(*four) for four in zip(baseline_curves, finals, runs, bases)]
    logs = [math.log(r) for r, b in per_seed if b is None]
    if len(logs) == len(per_seed) > 1 and varied_nothing(logs, [1.0]):
        return Speedup(math.exp(mean(logs)), None, None, None, len(per_seed), tuple(per_seed))
    return combine_speedups(per_seed, confidence)


def unpaired_speedup(
    baseline_curves: Sequence[Curve],
    finals: Sequence[Final],
    confidence: float = CONFIDENCE,
    run_curves: Optional[Sequence[Curve]] = None,
    baseline_finals: Optional[Sequence[Final]] = None,
) -> tuple[Speedup, list[list[tuple[float, Optional[str]]]]]:
    """Speedup of runs whose seeds the baseline did not run: every run i matched against every baseline seed j
    (:func:`matched_ratio`), log r_ij = log s + a_i - b_j, a run's luck and a baseline seed's. The geometric mean of
    all r_ij, with Welch's interval from the spread of the per-run means (the run's seed-to-seed spread) and of the
    per-baseline-seed means (the baseline's): matching against the baseline's mean curve as if it were exact left
    the baseline's spread out. Each pair is read either way as :func:`two_way_ratio` does, given the runs' curves
    and the baseline's finals. Bounds among the r_ij give a bound every pair supports, at the level of as many
    independent pairs as the smaller side has seeds (pairs sharing no run). Also returns the matrix."""
    if not finals or not baseline_curves:
        raise ValueError("unpaired_speedup needs runs and baseline curves")
    runs = run_curves or [None] * len(finals)
    bases = baseline_finals or [None] * len(baseline_curves)
    matrix = [
        [two_way_ratio(curve, final, run, base) for curve, base in zip(baseline_curves, bases)]
        for final, run in zip(finals, runs)
    ]
    pairs = [rb for row in matrix for rb in row]
    if any(b is not None for _, b in pairs):
        bounded = combine_speedups(pairs, confidence, min(len(finals), len(baseline_curves)))
        b = bounded
        return Speedup(b.value, b.bound, None, None, len(finals), b.per_seed, b.level), matrix
    logs = np.log(np.asarray([[r for r, _ in row] for row in matrix]))
    centre = float(logs.mean())
    per_run = tuple((float(math.exp(m)), None) for m in logs.mean(axis=1))
    n_a, n_b = logs.shape
    if n_a < 2 or n_b < 2:
        return Speedup(math.exp(centre), None, None, None, n_a, per_run), matrix
    rows, columns = logs.mean(axis=1), logs.mean(axis=0)
    if varied_nothing(list(rows), [1.0]) or varied_nothing(list(columns), [1.0]):
        return Speedup(math.exp(centre), None, None, None, n_a, per_run), matrix
    va, vb = rows.var(ddof=1) / n_a, columns.var(ddof=1) / n_b
    df = (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * math.sqrt(va + vb)
    low, high = math.exp(centre - half), math.exp(centre + half)
    return Speedup(math.exp(centre), None, low, high, n_a, per_run, confidence), matrix


# ----------------------------------------------------------------------------------------------------------------
# Loss against tokens over budgets: L(D) = alpha * D^(-beta) + gamma


@dataclass(frozen=True)
class PowerLaw:
    alpha: float
    beta: float
    gamma: float
    rms_residual: float

    def loss(self, tokens: float) -> float:
        return self.alpha * tokens ** (-self.beta) + self.gamma

    def tokens_for(self, loss: float) -> float:
        """D with L(D) = loss; infinite at or below the floor gamma (no budget reaches it)."""
        if loss <= self.gamma:
            return math.inf
        return (self.alpha / (loss - self.gamma)) ** (1.0 / self.beta)


_BETA_RANGE = (1e-3, 5.0)  # the exponents a fit may take; LLM loss-vs-data exponents are about 0.1 to 0.5
_BETA_GRID = 201  # the coarse scan of log(beta), then golden-section refinement
_GOLDEN_STEPS = 100


@dataclass(frozen=True)
class PowerLaws:
    """Many fits at once (one per row of losses): ``ok`` False where no power law to read tokens from fits (then
    the row's parameters are NaN)."""

    alpha: np.ndarray
    beta: np.ndarray
    gamma: np.ndarray
    sse: np.ndarray
    ok: np.ndarray


def fit_power_laws(tokens: Sequence[float], losses: np.ndarray) -> PowerLaws:
    """:func:`fit_power_law` for each row of ``losses`` (rows x budgets), vectorized over the rows: the bootstrap
    fits a thousand resamples in one call."""
    losses = np.atleast_2d(np.asarray(losses, dtype=float))
    d = np.asarray(tokens, dtype=float)
    scale = d.max()  # D / max(D) keeps D^(-beta) near 1 for every beta
    log_d = np.log(d / scale)
    y_centred = losses - losses.mean(axis=1, keepdims=True)

    def solve(log_beta: np.ndarray):
        """Least squares L = a x + c with x = (D / scale)^(-beta), for betas broadcast against the rows."""
        x = np.exp(-np.exp(log_beta)[..., None] * log_d)  # (..., budgets)
        x_centred = x - x.mean(axis=-1, keepdims=True)
        sxx = (x_centred**2).sum(axis=-1)
        a = np.where(sxx > 0, (x_centred * y_centred).sum(axis=-1) / np.where(sxx > 0, sxx, 1.0), 0.0)
        c = losses.mean(axis=1) - a * x.mean(axis=-1)
        sse = ((a[..., None] * x + c[..., None] - losses) ** 2).sum(axis=-1)
        return a, c, sse

    def cost(log_beta: np.ndarray) -> np.ndarray:
        a, _, sse = solve(log_beta)
        return np.where(a > 0, sse, np.inf)

    rows = losses.shape[0]
    grid = np.log(_BETA_RANGE[0]) + np.arange(_BETA_GRID) * (
        (np.log(_BETA_RANGE[1]) - np.log(_BETA_RANGE[0])) / (_BETA_GRID - 1)
    )
    costs = cost(np.broadcast_to(grid[:, None], (_BETA_GRID, rows)))  # (grid, rows)
    best = np.argmin(costs, axis=0)
    found = np.isfinite(costs[best, np.arange(rows)])
    low, high = grid[np.maximum(best - 1, 0)], grid[np.minimum(best + 1, _BETA_GRID - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = high - ratio * (high - low), low + ratio * (high - low)
    for _ in range(_GOLDEN_STEPS):
        left = cost(x1) < cost(x2)  # the minimum lies in [low, x2]: drop (x2, high]; else in [x1, high]
        high, low = np.where(left, x2, high), np.where(left, low, x1)
        x1, x2 = np.where(left, high - ratio * (high - low), x2), np.where(left, x1, low + ratio * (high - low))
    beta = np.exp((low + high) / 2.0)
    a, gamma, sse = solve(np.log(beta))
    at_an_end = ~((1.01 * _BETA_RANGE[0] < beta) & (beta < _BETA_RANGE[1] / 1.01))
    ok = found & (a > 0) & ~at_an_end & (gamma >= 0) & (len(set(tokens)) >= 3)
    nan = np.full(rows, np.nan)
    # alpha * (D / scale)^(-beta) = (alpha * scale^beta) * D^(-beta)
    return PowerLaws(np.where(ok, a * scale**beta, nan), np.where(ok, beta, nan), np.where(ok, gamma, nan), sse, ok)


def fit_power_law(tokens: Sequence[float], losses: Sequence[float]) -> Optional[PowerLaw]:
    """Least-squares fit of L(D) = alpha * D^(-beta) + gamma, alpha > 0 and beta > 0, to three or more budgets.

    For a fixed beta the best alpha and gamma are a linear fit of L against D^(-beta); beta is found by a coarse
    scan of log(beta) then golden-section refinement. None when fewer than three distinct budgets are given, when
    no falling power law fits (the loss does not decrease with the budget), or when the best fit is not one to
    read tokens from: beta at an end of the scanned range [1e-3, 5] (the curve is no power law over these budgets,
    e.g. a loss falling linearly in log D), or a floor gamma below zero (no cross-entropy gets there).
    """
    if len(set(tokens)) < 3 or len(tokens) != len(losses):
        return None
    fits = fit_power_laws(tokens, np.asarray([losses], dtype=float))
    if not fits.ok[0]:
        return None
    return PowerLaw(
        float(fits.alpha[0]), float(fits.beta[0]), float(fits.gamma[0]), math.sqrt(float(fits.sse[0]) / len(tokens))
    )


BOOTSTRAP_RESAMPLES = 1000


@dataclass(frozen=True)
class FitTarget:
    """A loss to read D_eff from: the ``tokens`` a cell used and its per-seed ``losses``. ``paired_with``: the index
    of a fit point whose runs ran the same seeds in the same order (the same runs, or the baseline's at that budget
    on those seeds), whose draw it then shares (see :func:`bootstrap_power_law`)."""

    tokens: float
    losses: Sequence[float]
    paired_with: Optional[int] = None


@dataclass(frozen=True)
class FitInterval:
    """Percentile bootstrap intervals of a power-law fit (see :func:`bootstrap_power_law`). An end is -inf / inf
    where the failed resamples alone reach past it (``failed`` of ``resamples`` found no power law), and a
    D_eff / D's upper end inf also where resamples put its loss at or below the floor (``below_floor`` counts them
    per target)."""

    alpha: tuple[float, float]
    beta: tuple[float, float]
    gamma: tuple[float, float]
    speedups: tuple[tuple[float, float], ...]
    fits: int
    resamples: int
    below_floor: tuple[int, ...] = ()

    @property
    def failed(self) -> int:
        return self.resamples - self.fits


def percentile_interval(values: np.ndarray, failed: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of ``values`` plus ``failed`` resamples that gave no value, counted as unknown: at
    -inf for the lower end and at inf for the upper (so that dropping them cannot narrow the interval)."""
    values = np.sort(np.asarray(values, dtype=float))
    total = len(values) + failed
    tail = (1.0 - confidence) / 2.0
    k_low, k_high = math.ceil(tail * total), math.ceil((1.0 - tail) * total)  # 1-based, as "inverted_cdf"
    low = -math.inf if k_low <= failed else float(values[k_low - failed - 1])
    high = math.inf if k_high > len(values) else float(values[k_high - 1])
    return low, high


def bootstrap_power_law(
    points: Sequence[tuple[float, Sequence[float]]],
    targets: Sequence = (),
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Optional[FitInterval]:
    """Intervals for :func:`fit_power_law` over ``points`` = (tokens, per-seed losses) and for each target's
    D_eff / D (a :class:`FitTarget`, or (tokens, per-seed losses) drawn on its own). Seeded, so a report rebuilt is
    the same. None when a budget or target has fewer than two seeds (no standard error).

    Each resample draws each point's mean from its t distribution (mean + s / sqrt(n) T, T ~ t(n - 1): resampling
    two or three seeds themselves covers far less than 95%), fits, and reads each target's drawn mean off the fit.
    A target paired with a point draws its mean as that point's draw plus a draw of their paired mean difference
    (the same runs: exactly the point's draw), so that what they share varies together. Resamples that fit no
    power law are counted, not dropped (:func:`percentile_interval`)."""
    targets = [t if isinstance(t, FitTarget) else FitTarget(t[0], t[1]) for t in targets]
    if any(len(losses) < 2 for _, losses in points) or any(len(t.losses) < 2 for t in targets):
        return None
    rng = np.random.default_rng(seed)

    def draw(values: Sequence[float]) -> np.ndarray:
        values = np.asarray(values, dtype=float)
        spread = values.std(ddof=1) / math.sqrt(len(values))
        return values.mean() + spread * rng.standard_t(len(values) - 1, resamples)

    drawn = np.stack([draw(losses) for _, losses in points], axis=1)  # (resamples, points)
    fits = fit_power_laws([d for d, _ in points], drawn)
    ok = fits.ok
    ratios, below = [], []
    for t in targets:
        if t.paired_with is None:
            mean_drawn = draw(t.losses)
        else:
            base = points[t.paired_with][1]
            if len(base) != len(t.losses):
                raise ValueError("a paired target needs one loss per seed of its point, in the same order")
            mean_drawn = drawn[:, t.paired_with] + draw([x - y for x, y in zip(t.losses, base)])
        excess = mean_drawn[ok] - fits.gamma[ok]
        with np.errstate(divide="ignore", invalid="ignore"):
            d_eff = np.where(
                excess > 0, (fits.alpha[ok] / np.where(excess > 0, excess, 1.0)) ** (1.0 / fits.beta[ok]), np.inf
            )
        ratios.append(d_eff / t.tokens)
        below.append(int(np.sum(excess <= 0)))
    failed = int(resamples - ok.sum())

    def interval(values) -> tuple[float, float]:
        return percentile_interval(values, failed, confidence)

    return FitInterval(
        interval(fits.alpha[ok]),
        interval(fits.beta[ok]),
        interval(fits.gamma[ok]),
        tuple(interval(r) for r in ratios),
        int(ok.sum()),
        resamples,
        tuple(below),
    )
