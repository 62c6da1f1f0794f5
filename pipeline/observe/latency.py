"""Each sample's request latency, summarised: the ETA's cost shape where the stage reports it.

The extraction times every request and the manifest keeps it (`samples.latency_s`); observations
carry the done samples' sufficient statistics per power-of-two length bin (progress field
`latency_moments`), so the fit below needs no per-sample rows. See `pipeline/observe/eta.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.manifest import LATENCY_SUMS
from pipeline.observe.costfit import TERMS, CostModel, NormalSums, fit_nonnegative

MOMENT_KEYS = LATENCY_SUMS  # the manifest's per-bin sums, in its order


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

    def sums(self) -> NormalSums:
        """The normal equations of the fit, rows (r, 1, tokens) against s; coefficients (a, b, c)."""
        m = self
        return NormalSums(xx=[[m.sum_inv_sq, m.sum_inv, m.samples], [m.sum_inv, m.samples, m.sum_tokens],
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
    def from_bins(bins: dict | None) -> LatencyProfile | None:
        """The profile of a manifest's raw per-bin sums (`manifest.summarize`'s latency_bins), or None."""
        if not bins:
            return None
        return LatencyProfile({int(b): LatencyMoments(*(float(v) for v in vals)) for b, vals in bins.items()})

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
            sums = NormalSums()
            for w, (m, _) in zip(weights, bins, strict=True):
                b = m.sums()
                sums.xx = [[x + w * y for x, y in zip(r1, r2, strict=True)] for r1, r2 in zip(sums.xx, b.xx, strict=True)]
                sums.xy = [x + w * y for x, y in zip(sums.xy, b.xy, strict=True)]
                sums.yy += w * b.yy
                sums.count += m.samples
            self.sums = sums
            got = fit_nonnegative(sums, [True] * TERMS)
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
