"""Cost-aware ETA: time ≈ a·samples + b·tokens (+ c·tokens²), fitted by decayed non-negative least squares.

Short prompts are dominated by per-request overhead (a), long ones by tokens (b) and,
through attention, by tokens² (c). On a dataset sorted by prompt length a rate in
samples/s (tqdm's EMA, the plain average) misses by a wide margin because later samples
cost more; a linear fit misses too when the cost is superlinear. Where the stage reports
Σtokens² (the extraction knows every sample's length before it starts: progress fields
`tokens_sq_done` / `tokens_sq_total`), the fit has the quadratic term and the prediction
sums it over exactly the remaining samples.

The fit is over spans of several progress intervals, not over single 10-s ticks: the
samples completed in one tick are a few whole samples plus a boundary that the tick cuts
arbitrarily, which biases a per-tick fit low (regression dilution). Spans grow with the
run (elapsed / 60, between 20 s and 5 min). The coefficients are non-negative (a cost
cannot be negative): the best fit over every subset of the terms is kept. Sums decay with
time so recent behaviour weighs more; two half-lives give the band.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from pipeline.verdict import fmt_s

TERMS = 3  # samples, tokens, tokens²


@dataclass
class _Sums:
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

    def add(self, x: list[float], y: float) -> None:
        for i in range(TERMS):
            self.xy[i] += x[i] * y
            for j in range(TERMS):
                self.xx[i][j] += x[i] * x[j]
        self.yy += y * y
        self.count += 1


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


class CostModel:
    """Decayed weighted non-negative least squares of time on the work done."""

    def __init__(self, *, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.sums = _Sums()
        self.last_t: float | None = None
        self.present = [True] * TERMS  # a term counts only if every row carried it
        self._coef: tuple[float, ...] | None = None
        self._dirty = True

    def add(self, *, t: float, dt: float, samples: float, tokens: float | None,
            tokens_sq: float | None = None) -> None:
        """Record that `samples` (with `tokens` and Σtokens² `tokens_sq`) took `dt` seconds, ending at `t`."""
        if self.last_t is not None and t > self.last_t:
            self.sums.scale(0.5 ** ((t - self.last_t) / self.half_life_s))
        self.last_t = t
        x = [samples, tokens, tokens_sq]
        for i, v in enumerate(x):
            if v is None:
                self.present[i] = False
        self.sums.add([v or 0.0 for v in x], dt)
        self._dirty = True

    def coefficients(self) -> tuple[float, ...] | None:
        """(seconds per sample, per token, per token²), all ≥ 0, or None before any data."""
        if not self._dirty:
            return self._coef
        self._dirty = False
        s = self.sums
        self._coef = None
        if s.count <= 0 or s.xx[0][0] <= 0:
            return None
        usable = [i for i in range(TERMS) if self.present[i] and s.xx[i][i] > 0]
        scale = {i: math.sqrt(s.xx[i][i]) for i in usable}
        best: tuple[float, list[float], tuple[int, ...]] | None = None
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
                    best = (rss, beta, sub)
        if best is None:
            return None
        coef = [0.0] * TERMS
        for bi, i in zip(best[1], best[2], strict=True):
            coef[i] = bi / scale[i]
        self._coef = tuple(coef)
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
        self._fit = (full, scale, a_full, max(rss, 0.0) / max(s.count - len(full), 1.0))
        return self._coef

    def predict_sd(self, *, samples: float, tokens: float | None, tokens_sq: float | None = None) -> float | None:
        """The standard error of `predict` for this much work: σ·√(x'(X'X)⁻¹x) with σ from the residuals.
        Large where the fit extrapolates (long prompts still to come, seen only short ones)."""
        if self.coefficients() is None:
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


@dataclass(frozen=True)
class Eta:
    """An ETA with its band, in seconds from now."""

    eta_s: float
    low_s: float
    high_s: float


class EtaEstimator:
    """Two cost models (recent and long memory) over spans; their spread and the long fit's standard
    error make the band.

    From the third span on there may be an ETA. The band is two standard errors of the fit's
    prediction (wide where it extrapolates: longer prompts still to come than any seen) and the two
    memories' spread. A band wider than EARLY_BAND_RATIO (before MIN_INTERVALS spans) or
    MAX_BAND_RATIO (after) would mislead more than it tells: the ETA is withheld, and `why` says so."""

    EARLY_INTERVALS = 3
    MIN_INTERVALS = 20
    MAX_BAND_RATIO = 4.0
    EARLY_BAND_RATIO = 3.0
    SPANS_PER_RUN = 60.0
    SPAN_MIN_S, SPAN_MAX_S = 20.0, 300.0
    EXTRAPOLATION_LIMIT = 3.5  # the prompts left may be this much longer than the longest span's

    def __init__(self, *, short_half_life_s: float = 1800.0, long_half_life_s: float = 7200.0) -> None:
        self.short = CostModel(half_life_s=short_half_life_s)
        self.long = CostModel(half_life_s=long_half_life_s)
        self.intervals = 0  # spans fitted
        self.first_t: float | None = None
        self.why: str | None = None  # why the last estimate was withheld
        self._open: list | None = None  # [dt, samples, tokens, tokens_sq] not yet closed into a span
        self.widest = 0.0  # the longest span's typical prompt (√(Σtokens²/samples), or tokens/samples)

    def add(self, *, t: float, dt: float, samples: float, tokens: float | None, tokens_sq: float | None = None) -> None:
        """Feed one interval between progress events."""
        if dt <= 0 or samples <= 0:
            return
        if self.first_t is None:
            self.first_t = t - dt
        if self._open is None:
            self._open = [0.0, 0.0, 0.0, 0.0]
            self._has = [tokens is not None, tokens_sq is not None]
        o = self._open
        o[0] += dt
        o[1] += samples
        o[2] += tokens or 0.0
        o[3] += tokens_sq or 0.0
        self._has = [self._has[0] and tokens is not None, self._has[1] and tokens_sq is not None]
        span = min(self.SPAN_MAX_S, max(self.SPAN_MIN_S, (t - self.first_t) / self.SPANS_PER_RUN))
        if o[0] >= span:
            k = o[2] if self._has[0] else None
            q = o[3] if self._has[1] else None
            self.short.add(t=t, dt=o[0], samples=o[1], tokens=k, tokens_sq=q)
            self.long.add(t=t, dt=o[0], samples=o[1], tokens=k, tokens_sq=q)
            self.intervals += 1
            if self._has[1]:
                self.widest = max(self.widest, math.sqrt(o[3] / o[1]))
            elif self._has[0]:
                self.widest = max(self.widest, o[2] / o[1])
            self._open = None

    def estimate(self, *, samples_left: float, tokens_left: float | None,
                 tokens_sq_left: float | None = None) -> Eta | None:
        """The ETA, or None while the band would be meaningless."""
        self.why = None
        if self.intervals < self.EARLY_INTERVALS:
            self.why = f"{self.intervals} span(s) of progress so far; an ETA needs {self.EARLY_INTERVALS}"
            return None
        if samples_left <= 0:
            return Eta(0.0, 0.0, 0.0)
        short = self.short.predict(samples=samples_left, tokens=tokens_left, tokens_sq=tokens_sq_left)
        long = self.long.predict(samples=samples_left, tokens=tokens_left, tokens_sq=tokens_sq_left)
        if short is None or long is None or short <= 0 or long <= 0:
            self.why = "the cost fit has no term for the work left (token counts missing)"
            return None
        eta = 0.5 * short + 0.5 * long
        # A fit extrapolated far past the longest prompts seen is a guess, and its standard error
        # (from the same fit) does not know it: seen only 700-token prompts, 3,000-token ones to come.
        ahead = (math.sqrt(tokens_sq_left / samples_left) if tokens_sq_left is not None
                 else (tokens_left / samples_left if tokens_left is not None else None))
        if ahead is not None and self.widest > 0 and ahead > self.EXTRAPOLATION_LIMIT * self.widest:
            self.why = (f"withheld: the prompts left are {ahead / self.widest:.1f}× longer than any seen so far "
                        f"(typical {ahead:,.0f} tokens against {self.widest:,.0f}); the cost fit would be a guess "
                        f"until the work reaches longer prompts")
            return None
        # the band: the two memories' spread, and two standard errors of the long fit's prediction
        sd = self.long.predict_sd(samples=samples_left, tokens=tokens_left, tokens_sq=tokens_sq_left) or 0.0
        low = min(short, long, eta - 2 * sd) / 1.05
        high = max(short, long, eta + 2 * sd) * 1.05
        cap = self.EARLY_BAND_RATIO if self.intervals < self.MIN_INTERVALS else self.MAX_BAND_RATIO
        if low <= 0 or high / low > cap:
            self.why = (f"withheld: the work left is unlike the work done so far (e.g. longer prompts to come), "
                        f"so the estimate could be anywhere from {fmt_s(max(low, 0.0))} to {fmt_s(high)}")
            return None
        return Eta(eta, low, high)
