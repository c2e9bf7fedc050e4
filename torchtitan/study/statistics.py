"""The study's statistics: Student's t, Welch's interval for a difference of means, tokens to reach a loss along a
curve, speedup at matched loss, and the power-law fit of loss against tokens.

Pure functions of numbers (no torch, no numpy, no scipy), so the report is the same wherever it is rebuilt and each
function is tested on made-up values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

CONFIDENCE = 0.95
BETTER, WORSE, NO_DIFFERENCE = "better", "worse", "no detectable difference"


# ----------------------------------------------------------------------------------------------------------------
# Student's t distribution


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    # The fraction converges fast on this side of the mean; the other side by symmetry.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - front * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0 < p < 1), by bisection on the CDF (monotone, so it cannot miss)."""
    if not (0.0 < p < 1.0) or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0; got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    high = 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    low = 0.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2.0


# ----------------------------------------------------------------------------------------------------------------
# Means over seeds and differences between them


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


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) with Welch's confidence interval (unequal variances, Welch–Satterthwaite df)."""

    difference: float
    low: float
    high: float
    df: Optional[float]  # None when neither side has any spread (the interval is then the point itself)
    n_a: int
    n_b: int

    @property
    def verdict(self) -> str:
        """For losses (lower is better): a is better when the whole interval is below 0, worse when above."""
        if self.high < 0:
            return BETTER
        if self.low > 0:
            return WORSE
        return NO_DIFFERENCE


def welch_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Optional[Difference]:
    """Welch's t interval of mean(a) - mean(b); None unless both sides have at least two values."""
    if len(a) < 2 or len(b) < 2:
        return None
    difference = mean(a) - mean(b)
    va, vb = sample_variance(a) / len(a), sample_variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Difference(difference, difference, difference, None, len(a), len(b))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * se
    return Difference(difference, difference - half, difference + half, df, len(a), len(b))


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


@dataclass(frozen=True)
class Speedup:
    """D_eff / D: the tokens the baseline needs to reach a loss over the tokens the run used to reach it.

    ``bound`` as in :class:`Reach`: ">" a lower bound (the baseline never got there), "<" an upper bound. ``low``
    and ``high`` are the confidence interval over seeds (None with one seed, or when a seed's speedup is a bound).
    """

    value: float
    bound: Optional[str]
    low: Optional[float]
    high: Optional[float]
    seeds: int


def speedup_at_matched_loss(
    baseline_curves: Sequence[tuple[Sequence[float], Sequence[float]]],
    finals: Sequence[tuple[float, float]],
    confidence: float = CONFIDENCE,
) -> Speedup:
    """Speedup over seeds: ``finals[i]`` = (final loss, tokens used) of seed i, matched against the baseline curve
    ``baseline_curves[i]`` = (tokens, losses) (the same seed of the baseline, or its mean curve for every seed).

    The estimate is the geometric mean of the per-seed speedups, its interval the t interval of their logarithms
    (a ratio's spread is symmetric on a log scale). Any bound among the seeds makes the whole a bound, without an
    interval: the smallest lower bound when the baseline never got there for some seed, else the largest upper.
    """
    if not finals or len(finals) != len(baseline_curves):
        raise ValueError("speedup_at_matched_loss needs one baseline curve per seed")
    ratios, bounds = [], []
    for (tokens, losses), (loss, used) in zip(baseline_curves, finals):
        reach = tokens_to_reach(tokens, losses, loss)
        ratios.append(reach.tokens / used)
        bounds.append(reach.bound)
    if ">" in bounds:
        return Speedup(min(r for r, b in zip(ratios, bounds) if b == ">"), ">", None, None, len(finals))
    if "<" in bounds:
        return Speedup(max(r for r, b in zip(ratios, bounds) if b == "<"), "<", None, None, len(finals))
    logs = [math.log(r) for r in ratios]
    centre = mean(logs)
    half = mean_ci(logs, confidence)
    if half is None:
        return Speedup(math.exp(centre), None, None, None, len(finals))
    return Speedup(math.exp(centre), None, math.exp(centre - half), math.exp(centre + half), len(finals))


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


def _linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a * x + c: (a, c, sum of squared residuals)."""
    mx, my = mean(xs), mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    c = my - a * mx
    return a, c, sum((a * x + c - y) ** 2 for x, y in zip(xs, ys))


_BETA_RANGE = (1e-3, 5.0)  # the exponents a fit may take; LLM loss-vs-data exponents are about 0.1 to 0.5


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
    scale = max(tokens)  # D / max(D) keeps D^(-beta) near 1 for every beta

    def solve(beta: float) -> tuple[float, float, float]:
        xs = [(d / scale) ** (-beta) for d in tokens]
        return _linear_fit(xs, losses)

    def cost(log_beta: float) -> float:
        a, _, sse = solve(math.exp(log_beta))
        return sse if a > 0 else math.inf

    grid = [
        math.log(_BETA_RANGE[0]) + i * (math.log(_BETA_RANGE[1]) - math.log(_BETA_RANGE[0])) / 200 for i in range(201)
    ]
    costs = [cost(g) for g in grid]
    best = min(range(len(grid)), key=costs.__getitem__)
    if not math.isfinite(costs[best]):
        return None
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = high - ratio * (high - low), low + ratio * (high - low)
    for _ in range(100):
        if cost(x1) < cost(x2):
            high, x2 = x2, x1
            x1 = high - ratio * (high - low)
        else:
            low, x1 = x1, x2
            x2 = low + ratio * (high - low)
    beta = math.exp((low + high) / 2.0)
    a, gamma, sse = solve(beta)
    at_an_end = not (1.01 * _BETA_RANGE[0] < beta < _BETA_RANGE[1] / 1.01)
    if not a > 0 or at_an_end or gamma < 0:
        return None
    # alpha * (D / scale)^(-beta) = (alpha * scale^beta) * D^(-beta)
    return PowerLaw(a * scale**beta, beta, gamma, math.sqrt(sse / len(tokens)))
