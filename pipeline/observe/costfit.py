"""Decayed weighted non-negative least squares of time on the work done: the fit under the ETA.

Rows are (samples, tokens, Σtokens²) against seconds; the coefficients are non-negative (a cost
cannot be negative): the best fit over every subset of the terms is kept, and the uncertainty comes
from the unconstrained fit. See `pipeline/observe/eta.py` for how the ETA uses it.

Where the rows do not tell the cost's curvature (data in two or three length buckets: a line and a
parabola fit two levels equally well), `CostModel.predict_range` gives the range of predictions over
every non-negative fit the rows cannot tell from the best: the quadratic coefficient stepped from 0 to
beyond the steepest fit, (a, b) fitted at each step, kept where the residual sum of squares is within
`PROFILE_KAPPA` residual variances of the best (the profile likelihood's ~95 % interval for c).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

TERMS = 3  # samples, tokens, tokens²
PROFILE_KAPPA = 4.0  # χ² with one degree of freedom at ~95 %
# ... where the rows' Σtokens² are themselves estimates (token counts alone: `EtaEstimator._within`), whose
# errors the residuals do not show: χ²₁ at ~98.6 %. Measured on the benchmark's tokens-only rows (5 seeds):
# ascending length buckets at 25 % 11.4 % off (16.3 on the worst seed) → 6.3 % (11.2); up to 1.5 points
# worse at 50 % where the cost is far more or less superlinear than the benchmark's.
PROFILE_KAPPA_ESTIMATED = 6.0
PROFILE_STEPS = 48


@dataclass
class NormalSums:
    """Decayed normal equations: X'X, X'y, y'y over rows x = (samples, tokens, tokens²), y = seconds."""

    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * TERMS for _ in range(TERMS)])
    xy: list[float] = field(default_factory=lambda: [0.0] * TERMS)
    yy: float = 0.0
    count: float = 0.0

    def scale(self, f: float) -> None:
        self.xx = [[v * f for v in row] for row in self.xx]
        self.xy = [v * f for v in self.xy]
        self.yy *= f
        self.count *= f

    def add(self, x: list[float], y: float, w: float = 1.0) -> None:
        """Add the row (x, y) with weight w (−1 takes back a row added before)."""
        for i in range(TERMS):
            self.xy[i] += w * x[i] * y
            for j in range(TERMS):
                self.xx[i][j] += w * x[i] * x[j]
        self.yy += w * y * y
        self.count += w


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-9:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _best_subset(s: NormalSums, usable: list[int]) -> tuple[float, list[float], tuple[int, ...],
                                                              dict[int, float]] | None:
    """The non-negative least-squares fit over every subset of the `usable` terms: (residual sum of
    squares, coefficients in scaled coordinates, the subset, the scales), or None if none is non-negative."""
    scale = {i: math.sqrt(s.xx[i][i]) for i in usable}
    best: tuple[float, list[float], tuple[int, ...], dict[int, float]] | None = None
    for r in range(1, len(usable) + 1):
        for sub in itertools.combinations(usable, r):
            a = [[s.xx[i][j] / (scale[i] * scale[j]) for j in sub] for i in sub]
            beta = _solve(a, [s.xy[i] / scale[i] for i in sub])
            if beta is None or min(beta) < 0:
                continue
            # residual sum of squares, in the scaled coordinates: y'y − 2β'X'y + β'X'Xβ
            rss = s.yy - 2 * sum(bi * s.xy[i] / scale[i] for bi, i in zip(beta, sub, strict=True)) + sum(
                beta[p] * beta[q] * a[p][q] for p in range(r) for q in range(r))
            if best is None or rss < best[0] - 1e-12 * max(s.yy, 1.0):
                best = (rss, beta, sub, scale)
    return best


def fit_nonnegative(s: NormalSums, present: list[bool]) -> tuple[tuple[float, ...], tuple] | None:
    """Non-negative least squares from the normal equations: the best fit over every subset of the
    terms with all coefficients ≥ 0, and (terms, scale, scaled X'X, residual variance) of the
    unconstrained fit for the standard errors; None before any data."""
    if s.count <= 0 or s.xx[0][0] <= 0:
        return None
    usable = [i for i in range(TERMS) if present[i] and s.xx[i][i] > 0]
    best = _best_subset(s, usable)
    if best is None:
        return None
    scale = best[3]
    coef = [0.0] * TERMS
    for bi, i in zip(best[1], best[2], strict=True):
        coef[i] = bi / scale[i]
    coef_t = tuple(coef)
    # The uncertainty comes from the unconstrained fit over every usable term: a constrained fit
    # that lands on a bound (a term dropped) would claim a precision it does not have.
    full = tuple(usable)
    a_full = [[s.xx[i][j] / (scale[i] * scale[j]) for j in full] for i in full]
    beta = _solve(a_full, [s.xy[i] / scale[i] for i in full])
    if beta is None:
        full, a_full, rss = best[2], [[s.xx[i][j] / (scale[i] * scale[j]) for j in best[2]] for i in best[2]], best[0]
    else:
        rss = s.yy - 2 * sum(bi * s.xy[i] / scale[i] for bi, i in zip(beta, full, strict=True)) + sum(
            beta[p] * beta[q] * a_full[p][q] for p in range(len(full)) for q in range(len(full)))
    return coef_t, (full, scale, a_full, max(rss, 0.0) / max(s.count - len(full), 1.0))


def _fit_given_c(s: NormalSums, c: float, usable: list[int]) -> tuple[float, list[float]]:
    """(rss, coefficients) of the best non-negative (a, b) with the quadratic coefficient held at c: the
    same fit as `fit_nonnegative`'s on the time the quadratic term leaves (y − c·Σtokens²)."""
    left = NormalSums(xx=s.xx, xy=[s.xy[i] - c * s.xx[i][2] for i in range(TERMS)],
                      yy=s.yy - 2 * c * s.xy[2] + c * c * s.xx[2][2], count=s.count)
    coef = [0.0, 0.0, c]
    best = _best_subset(left, usable)
    if best is None or best[0] >= left.yy:  # no non-negative (a, b) does better than none
        return left.yy, coef
    for bi, i in zip(best[1], best[2], strict=True):
        coef[i] = bi / best[3][i]
    return best[0], coef


def profile_c(s: NormalSums, present: list[bool], kappa: float = PROFILE_KAPPA) -> list[list[float]] | None:
    """The non-negative fits (coefficient triples) the rows cannot tell from the best (their residuals
    within `kappa` of its, in units of its residual variance), over a grid of the quadratic coefficient;
    None where there is no quadratic term to profile."""
    if not present[2] or s.xx[2][2] <= 0 or s.count <= TERMS + 1:
        return None
    usable = [i for i in range(2) if present[i] and s.xx[i][i] > 0]
    steepest = s.xy[2] / s.xx[2][2]  # all of the time on tokens² (no a, no b)
    if steepest <= 0:
        return None
    fits = [_fit_given_c(s, 1.25 * steepest * k / PROFILE_STEPS, usable) for k in range(PROFILE_STEPS + 1)]
    least = min(rss for rss, _ in fits)
    limit = least + kappa * max(least, 0.0) / (s.count - TERMS)
    return [coef for rss, coef in fits if rss <= limit]


class CostModel:
    """Decayed weighted non-negative least squares of time on the work done."""

    def __init__(self, *, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.sums = NormalSums()
        self.last_t: float | None = None
        self.missing = [0] * TERMS  # rows (in the fit now) without each term: a term counts only if none lacks it
        self._coef: tuple[float, ...] | None = None
        self._fit: tuple | None = None
        self._dirty = True
        self._profile: list[list[float]] | None = None
        self._profile_dirty = True
        self.profile_kappa = PROFILE_KAPPA  # PROFILE_KAPPA_ESTIMATED where the rows' Σtokens² are estimates

    def add(self, *, t: float, dt: float, samples: float, tokens: float | None,
            tokens_sq: float | None = None) -> None:
        """Record that `samples` (with `tokens` and Σtokens² `tokens_sq`) took `dt` seconds, ending at `t`."""
        self._decay(t)
        x = [samples, tokens, tokens_sq]
        self.missing = [m + (v is None) for m, v in zip(self.missing, x, strict=True)]
        self.sums.add([v or 0.0 for v in x], dt)

    def remove(self, *, dt: float, samples: float, tokens: float | None, tokens_sq: float | None = None) -> None:
        """Take back a row added before: a window's fit (no decay, `half_life_s=math.inf`) as rows leave it."""
        self._dirty = self._profile_dirty = True
        x = [samples, tokens, tokens_sq]
        self.missing = [m - (v is None) for m, v in zip(self.missing, x, strict=True)]
        self.sums.add([v or 0.0 for v in x], dt, w=-1.0)

    @property
    def present(self) -> list[bool]:
        """Which terms every row in the fit carried."""
        return [m == 0 for m in self.missing]

    def _decay(self, t: float) -> None:
        if self.last_t is not None and t > self.last_t and math.isfinite(self.half_life_s):
            self.sums.scale(0.5 ** ((t - self.last_t) / self.half_life_s))
        self.last_t = t
        self._dirty = self._profile_dirty = True

    def coefficients(self) -> tuple[float, ...] | None:
        """(seconds per sample, per token, per token²), all ≥ 0, or None before any data."""
        if self._dirty:
            self._dirty = False
            got = fit_nonnegative(self.sums, self.present)
            self._coef, self._fit = got if got is not None else (None, None)
        return self._coef

    def sigma2(self) -> float:
        """The residual variance of a row (0 before a fit)."""
        return self._fit[3] if self.coefficients() is not None and self._fit is not None else 0.0

    def predict_range(self, *, samples: float, tokens: float | None,
                      tokens_sq: float | None = None) -> tuple[float, float] | None:
        """(lowest, highest) prediction over the non-negative fits the rows cannot tell from the best
        (`profile_c`); None without a quadratic term or data."""
        if self.coefficients() is None or tokens is None or tokens_sq is None:
            return None
        if self._profile is None or self._profile_dirty:
            self._profile_dirty = False
            self._profile = profile_c(self.sums, self.present, self.profile_kappa) or []
        values = (samples, tokens, tokens_sq)
        preds = [sum(c * v for c, v in zip(coef, values, strict=True)) for coef in self._profile]
        return (min(preds), max(preds)) if preds else None

    def predict_sd(self, *, samples: float, tokens: float | None, tokens_sq: float | None = None) -> float | None:
        """The standard error of `predict` for this much work: σ·√(x'(X'X)⁻¹x) with σ from the residuals.
        Large where the fit extrapolates (long prompts still to come, seen only short ones)."""
        if self.coefficients() is None or self._fit is None:
            return None
        chosen, scale, a, sigma2 = self._fit
        values = (samples, tokens, tokens_sq)
        x = [(values[i] or 0.0) / scale[i] for i in chosen]
        v = _solve(a, x)
        if v is None:
            return None
        return math.sqrt(max(sigma2 * sum(p * q for p, q in zip(x, v, strict=True)), 0.0))

    def predict(self, *, samples: float, tokens: float | None, tokens_sq: float | None = None) -> float | None:
        """Seconds to process `samples` more (with `tokens` and Σtokens² `tokens_sq` more); None if a
        fitted term has no value to multiply."""
        coef = self.coefficients()
        if coef is None:
            return None
        total = 0.0
        for c, v in zip(coef, (samples, tokens, tokens_sq), strict=True):
            if c > 0:
                if v is None:
                    return None
                total += c * v
        return total
