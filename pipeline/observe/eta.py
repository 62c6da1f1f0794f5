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

Where the stage also reports its requests' own latencies (the extraction does: progress field
`latency_moments`, see `LatencyMoments`), the *shape* of the cost — how much more a long prompt
costs than a short one — is fitted to every sample's own latency instead of to span sums, which
blur it (a span holds a dozen samples of similar length; on data sorted into length buckets the
spans cannot tell a from b from c). The wall clock then gives the *scale*: wall seconds per
latency second over recent spans (1 with one request at a time; about 1/concurrency when a
continuous-batching server shares its GPUs among the requests in flight, under which a request's
expected latency is proportional to its own cost).

Where the stage reports neither (only done/total/tokens), a span's Σtokens² is taken as tokens² /
samples — exact when its prompts are alike, as on length-sorted data, and proportional to the truth on
shuffled data — and the work left's is estimated from its mean and the current length
(`EtaEstimator._sq_left_range`), its bounds widening the band.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from pipeline.observe.verdict import fmt_s

TERMS = 3  # samples, tokens, tokens²
MOMENT_KEYS = ("samples", "sum_inv", "sum_inv_sq", "sum_tokens", "sum_tokens_sq",
               "sum_s", "sum_s_inv", "sum_s_tokens", "sum_s_sq")


@dataclass(frozen=True)
class LatencyMoments:
    """Sufficient statistics of the per-sample latency fit, over samples with a known latency.

    With s = latency / tokens (seconds per token) and r = 1 / tokens, the fit is
    s = a·r + b + c·tokens — that is latency = a + b·tokens + c·tokens² with each sample weighted
    by 1/tokens²: the noise is multiplicative (a long prompt's time varies in proportion to its
    cost), so per token the samples weigh about evenly. Stored cumulatively (counters, like
    `tokens_sq_done`); an interval's moments are the difference of two readings. JSON keys:
    `MOMENT_KEYS`."""

    samples: float = 0.0
    sum_inv: float = 0.0  # Σ r
    sum_inv_sq: float = 0.0  # Σ r²
    sum_tokens: float = 0.0  # Σ tokens
    sum_tokens_sq: float = 0.0  # Σ tokens²
    sum_s: float = 0.0  # Σ s
    sum_s_inv: float = 0.0  # Σ s·r
    sum_s_tokens: float = 0.0  # Σ s·tokens (= Σ latency)
    sum_s_sq: float = 0.0  # Σ s²

    @staticmethod
    def one(tokens: int, latency_s: float) -> LatencyMoments:
        """One sample's contribution."""
        r, s = 1.0 / tokens, latency_s / tokens
        return LatencyMoments(1.0, r, r * r, float(tokens), float(tokens) * tokens, s, s * r, latency_s, s * s)

    def __add__(self, other: LatencyMoments) -> LatencyMoments:
        return LatencyMoments(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def __sub__(self, other: LatencyMoments) -> LatencyMoments:
        return LatencyMoments(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[float, ...]:
        return tuple(getattr(self, k) for k in MOMENT_KEYS)

    def to_json(self) -> dict:
        return dict(zip(MOMENT_KEYS, self.values(), strict=True))

    @staticmethod
    def from_json(obj) -> LatencyMoments | None:
        """The moments in an observation's progress, or None when absent or malformed (unknown)."""
        if not isinstance(obj, dict):
            return None
        try:
            vals = [float(obj[k]) for k in MOMENT_KEYS]
        except (KeyError, TypeError, ValueError):
            return None
        if not all(math.isfinite(v) for v in vals) or vals[0] < 0:
            return None
        return LatencyMoments(*vals)

    def sums(self) -> _Sums:
        """The normal equations of the fit, rows (r, 1, tokens) against s; coefficients (a, b, c)."""
        m = self
        return _Sums(xx=[[m.sum_inv_sq, m.sum_inv, m.samples], [m.sum_inv, m.samples, m.sum_tokens],
                         [m.samples, m.sum_tokens, m.sum_tokens_sq]],
                     xy=[m.sum_s_inv, m.sum_s, m.sum_s_tokens], yy=m.sum_s_sq, count=m.samples)


def length_bin(tokens: int) -> int:
    """The power-of-two length bin a prompt falls in: its lower bound (700 tokens → 512)."""
    return 1 << (max(int(tokens), 1).bit_length() - 1)


@dataclass(frozen=True)
class LatencyProfile:
    """`LatencyMoments` per power-of-two length bin (JSON: {"512": {moments}, …}).

    Per bin, because the weights the fit needs are not known when the samples are counted: a
    sample's latency varies in proportion to its cost (a + b·tokens + c·tokens²), which the fit is
    still learning; within a bin the cost varies little, so one weight a bin, refined from the fit
    itself (iteratively reweighted least squares), comes close to weighting each sample by its own."""

    bins: dict[int, LatencyMoments] = field(default_factory=dict)

    @staticmethod
    def one(tokens: int, latency_s: float) -> LatencyProfile:
        return LatencyProfile({length_bin(tokens): LatencyMoments.one(tokens, latency_s)})

    def _merge(self, other: LatencyProfile, sign: float) -> LatencyProfile:
        out, zero = dict(self.bins), LatencyMoments()
        for k, m in other.bins.items():
            base = out.get(k, zero)
            out[k] = base + m if sign > 0 else base - m
        return LatencyProfile(out)

    def __add__(self, other: LatencyProfile) -> LatencyProfile:
        return self._merge(other, 1.0)

    def __sub__(self, other: LatencyProfile) -> LatencyProfile:
        return self._merge(other, -1.0)

    @property
    def samples(self) -> float:
        return sum(m.samples for m in self.bins.values())

    def went_back(self) -> bool:
        """A bin with fewer samples or less latency than none: counters that went back (a rebuilt manifest)."""
        return any(m.samples < -1e-9 or m.sum_s_tokens < -1e-9 for m in self.bins.values())

    def to_json(self) -> dict:
        return {str(k): m.to_json() for k, m in sorted(self.bins.items())}

    @staticmethod
    def from_json(obj) -> LatencyProfile | None:
        """The profile in an observation's progress, or None when absent or malformed (unknown)."""
        if not isinstance(obj, dict):
            return None
        bins = {}
        for k, v in obj.items():
            m = LatencyMoments.from_json(v)
            if m is None or not str(k).isdigit():
                return None
            bins[int(k)] = m
        return LatencyProfile(bins)


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


def _fit(s: _Sums, present: list[bool]) -> tuple[tuple[float, ...], tuple] | None:
    """Non-negative least squares from the normal equations: the best fit over every subset of the
    terms with all coefficients ≥ 0, and (terms, scale, scaled X'X, residual variance) of the
    unconstrained fit for the standard errors; None before any data."""
    if s.count <= 0 or s.xx[0][0] <= 0:
        return None
    usable = [i for i in range(TERMS) if present[i] and s.xx[i][i] > 0]
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
        self._decay(t)
        x = [samples, tokens, tokens_sq]
        for i, v in enumerate(x):
            if v is None:
                self.present[i] = False
        self.sums.add([v or 0.0 for v in x], dt)

    def _decay(self, t: float) -> None:
        if self.last_t is not None and t > self.last_t:
            self.sums.scale(0.5 ** ((t - self.last_t) / self.half_life_s))
        self.last_t = t
        self._dirty = True

    def coefficients(self) -> tuple[float, ...] | None:
        """(seconds per sample, per token, per token²), all ≥ 0, or None before any data."""
        if self._dirty:
            self._dirty = False
            got = _fit(self.sums, self.present)
            self._coef, self._fit = got if got is not None else (None, None)
        return self._coef

    def sigma2(self) -> float:
        """The residual variance of a row (0 before a fit)."""
        return self._fit[3] if self.coefficients() is not None else 0.0

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


class LatencyShape(CostModel):
    """The cost's shape, latency = a + b·tokens + c·tokens², fitted to every timed sample of the run
    (not decayed: the shape is the model's and the server's, not the moment's), one weight per
    length bin by iteratively reweighted least squares. Its residual variance is then the relative
    variance of one sample's latency."""

    ITERATIONS = 3

    def __init__(self) -> None:
        super().__init__(half_life_s=math.inf)
        self.profile = LatencyProfile()

    def add_profile(self, profile: LatencyProfile) -> None:
        self.profile = self.profile + profile
        self._dirty = True

    def coefficients(self) -> tuple[float, ...] | None:
        if not self._dirty:
            return self._coef
        self._dirty = False
        bins = [(m, m.sum_tokens / m.samples) for m in self.profile.bins.values() if m.samples > 0]
        # The first fit iterates from each sample weighted by 1/tokens²; later ones (the data grows by a
        # tick's worth) take one step from the last fit's weights, so a replay costs one fit a tick.
        prev, self._coef, self._fit = self._coef, None, None
        weights = [1.0] * len(bins) if prev is None else self._weights(prev, bins)
        for _ in range(self.ITERATIONS if prev is None else 1):
            sums = _Sums()
            for w, (m, _) in zip(weights, bins, strict=True):
                b = m.sums()
                sums.xx = [[x + w * y for x, y in zip(r1, r2, strict=True)] for r1, r2 in zip(sums.xx, b.xx, strict=True)]
                sums.xy = [x + w * y for x, y in zip(sums.xy, b.xy, strict=True)]
                sums.yy += w * b.yy
                sums.count += m.samples
            self.sums = sums
            got = _fit(sums, [True] * TERMS)
            if got is None:
                return None
            self._coef, self._fit = got
            weights = self._weights(self._coef, bins)
        return self._coef

    @staticmethod
    def _weights(coef: tuple[float, ...], bins: list) -> list[float]:
        """A per-token residual at length n has sd ∝ cost(n) / n: weight (n / cost(n))²."""
        a, b, c = coef
        return [(n / max(a + b * n + c * n * n, 1e-12)) ** 2 for _, n in bins]

    def timed_rms(self) -> float | None:
        """√(Σtokens² / samples) over the timed samples."""
        n = self.profile.samples
        return math.sqrt(sum(m.sum_tokens_sq for m in self.profile.bins.values()) / n) if n > 0 else None


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
    MIN_LATENCY_SAMPLES = 50
    LATENCY_BAND_SD = 3.0  # the latency fit's band: three standard errors of its sum over the work left
    # The prompts left may be this much longer (RMS) than those timed so far: beyond, the quadratic term is
    # extrapolated too far to trust (on the benchmark's lognormal lengths sorted ascending, this falls
    # between 10 % and 25 % of the run: 5.0–5.5× at 10 %, 4.1–4.2× at 25 %).
    LATENCY_EXTRAPOLATION_LIMIT = 4.5

    def __init__(self, *, short_half_life_s: float = 1800.0, long_half_life_s: float = 7200.0) -> None:
        self.short = CostModel(half_life_s=short_half_life_s)
        self.long = CostModel(half_life_s=long_half_life_s)
        self.intervals = 0  # spans fitted
        self.first_t: float | None = None
        self.why: str | None = None  # why the last estimate was withheld
        self._open: list | None = None  # [dt, samples, tokens, tokens_sq] not yet closed into a span
        self.widest = 0.0  # the longest span's typical prompt (√(Σtokens²/samples), or tokens/samples)
        # the latency path: the cost's shape from every sample's own latency (all of the run: the
        # shape is the model's and the server's, not the moment's), the scale from recent spans
        self.shape = LatencyShape()
        self.scales = (_Decayed(short_half_life_s), _Decayed(long_half_life_s))
        self._priced = False  # every tick of the open span carried latencies
        # Where the stage reports no Σtokens², a span's is taken as tokens² / samples (exact when its prompts
        # are alike, as on length-sorted data) and the work left's is estimated (`_sq_left_range`).
        self.sq_proxy = False
        self.recent_length: float | None = None  # the last span's mean prompt length, tokens

    def add(self, *, t: float, dt: float, samples: float, tokens: float | None, tokens_sq: float | None = None,
            latency: LatencyProfile | None = None) -> None:
        """Feed one interval between progress events (with its samples' latency moments, if known)."""
        if dt <= 0 or samples <= 0:
            return
        if self.first_t is None:
            self.first_t = t - dt
        if self._open is None:
            self._open = [0.0, 0.0, 0.0, 0.0]
            self._has = [tokens is not None, tokens_sq is not None]
            self._priced = True
        self.add_latency(latency)
        self._priced = self._priced and latency is not None
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
            if q is None and k is not None:  # Σtokens² not reported: the span's as if its prompts were alike
                q = k * k / o[1]
                self.sq_proxy = True
            if k is not None:
                self.recent_length = k / o[1]
            self.short.add(t=t, dt=o[0], samples=o[1], tokens=k, tokens_sq=q)
            self.long.add(t=t, dt=o[0], samples=o[1], tokens=k, tokens_sq=q)
            self.intervals += 1
            if self._has[1]:
                self.widest = max(self.widest, math.sqrt(o[3] / o[1]))
            elif self._has[0]:
                self.widest = max(self.widest, o[2] / o[1])
            if self._priced and self._has[1]:  # a span the latency path can price
                for sc in self.scales:
                    sc.add(t, (o[0], o[1], o[2], o[3]))
            self._open = None

    def add_latency(self, profile: LatencyProfile | None) -> None:
        """Samples' latencies, for the cost's shape only (directly: those finished before the first
        progress event, whose wall time is start-up but whose latencies are their own)."""
        if profile is not None and profile.samples > 0:
            self.shape.add_profile(profile)

    def estimate(self, *, samples_left: float, tokens_left: float | None,
                 tokens_sq_left: float | None = None) -> Eta | None:
        """The ETA, or None while the band would be meaningless."""
        self.why = None
        if self.intervals < self.EARLY_INTERVALS:
            self.why = f"{self.intervals} span(s) of progress so far; an ETA needs {self.EARLY_INTERVALS}"
            return None
        if samples_left <= 0:
            return Eta(0.0, 0.0, 0.0)
        if (self.shape.profile.samples >= self.MIN_LATENCY_SAMPLES and tokens_left is not None
                and tokens_sq_left is not None and all(sc.values[0] > 0 for sc in self.scales)):
            return self._by_latency(samples_left, tokens_left, tokens_sq_left)
        sq_range = None
        if tokens_sq_left is None and self.sq_proxy and tokens_left is not None:
            sq_range = self._sq_left_range(samples_left, tokens_left)
            tokens_sq_left = sq_range[1]
        short = self.short.predict(samples=samples_left, tokens=tokens_left, tokens_sq=tokens_sq_left)
        long = self.long.predict(samples=samples_left, tokens=tokens_left, tokens_sq=tokens_sq_left)
        if short is None or long is None or short <= 0 or long <= 0:
            self.why = "the cost fit has no term for the work left (token counts missing)"
            return None
        eta = 0.5 * short + 0.5 * long
        spread = [short, long]
        if sq_range is not None:  # the estimate of Σtokens² left is a guess: its bounds widen the band
            for q in (sq_range[0], sq_range[2]):
                spread += [self.short.predict(samples=samples_left, tokens=tokens_left, tokens_sq=q) or eta,
                           self.long.predict(samples=samples_left, tokens=tokens_left, tokens_sq=q) or eta]
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
        low = min(*spread, eta - 2 * sd) / 1.05
        high = max(*spread, eta + 2 * sd) * 1.05
        cap = self.EARLY_BAND_RATIO if self.intervals < self.MIN_INTERVALS else self.MAX_BAND_RATIO
        if low <= 0 or high / low > cap:
            self.why = (f"withheld: the work left is unlike the work done so far (e.g. longer prompts to come), "
                        f"so the estimate could be anywhere from {fmt_s(max(low, 0.0))} to {fmt_s(high)}")
            return None
        return Eta(eta, low, high)

    def _sq_left_range(self, n: float, k: float) -> tuple[float, float, float]:
        """(low, estimate, high) of Σtokens² over the work left when the stage does not report it. At
        least k² / n (all prompts alike). The estimate: the prompts left spread from the current length
        to beyond their mean as an exponential tail would (length-sorted data: the rest are the longer
        prompts; on shuffled data the current length is the mean and the spread term vanishes), which on
        lognormal lengths sorted ascending comes within 5 % of the truth from 10 % to 75 % progress. Shorter
        prompts to come (sorted descending): alike at best, spread as far as the current length at worst."""
        mean = k / n
        floor = k * k / n
        spread = n * (mean - (self.recent_length or mean)) ** 2
        if mean < (self.recent_length or mean):  # shorter prompts to come (sorted descending): no tail beyond
            return floor, floor, floor + spread
        return floor, floor + spread, floor + 2 * spread

    def _by_latency(self, n: float, k: float, q: float) -> Eta | None:
        """The latency path: Σ of each remaining sample's fitted latency, times wall seconds per latency
        second (short and long memory); the band adds two standard errors of the fit's sum."""
        lat_left = self.shape.predict(samples=n, tokens=k, tokens_sq=q)
        if not lat_left or lat_left <= 0:
            self.why = "the latency fit has no term for the work left"
            return None
        timed, ahead = self.shape.timed_rms() or 0.0, math.sqrt(q / n)
        if ahead > self.LATENCY_EXTRAPOLATION_LIMIT * timed:
            self.why = (f"withheld: the prompts left are {ahead / timed:.1f}× longer than those timed so far "
                        f"(RMS {ahead:,.0f} tokens against {timed:,.0f}); the cost of long prompts would be a "
                        f"guess until the work reaches longer ones")
            return None
        etas = []
        for sc in self.scales:
            _, sn, sk, sq = sc.values
            priced = self.shape.predict(samples=sn, tokens=sk, tokens_sq=sq)
            if not priced or priced <= 0:
                self.why = "the latency fit prices the recent work at nothing"
                return None
            etas.append(lat_left * sc.values[0] / priced)
        eta = sum(etas) / len(etas)
        # the fit's own uncertainty, and the noise of the samples still to come (σ² is the relative
        # variance of one latency; Σ cost² over the samples left is at least (Σ cost)² / n)
        sd_fit = self.shape.predict_sd(samples=n, tokens=k, tokens_sq=q) or 0.0
        sd = math.sqrt(sd_fit ** 2 + self.shape.sigma2() * lat_left ** 2 / n) * eta / lat_left
        low = min(*etas, eta - self.LATENCY_BAND_SD * sd) / 1.05
        high = max(*etas, eta + self.LATENCY_BAND_SD * sd) * 1.05
        cap = self.EARLY_BAND_RATIO if self.intervals < self.MIN_INTERVALS else self.MAX_BAND_RATIO
        if low <= 0 or high / low > cap:
            self.why = (f"withheld: the work left is unlike the work done so far (e.g. longer prompts to come), "
                        f"so the estimate could be anywhere from {fmt_s(max(low, 0.0))} to {fmt_s(high)}")
            return None
        return Eta(eta, low, high)


class _Decayed:
    """Sums of (seconds, samples, tokens, Σtokens²) over spans, halved every `half_life_s`."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.values = (0.0, 0.0, 0.0, 0.0)
        self.last_t: float | None = None

    def add(self, t: float, row: tuple[float, float, float, float]) -> None:
        f = 0.5 ** ((t - self.last_t) / self.half_life_s) if self.last_t is not None and t > self.last_t else 1.0
        self.last_t = t
        self.values = tuple(v * f + r for v, r in zip(self.values, row, strict=True))
