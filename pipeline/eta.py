"""Cost-aware ETA: time ≈ a·samples + b·tokens, fitted by decayed least squares.

Short prompts are dominated by per-request overhead (a), long ones by tokens (b); on a
dataset sorted by prompt length, a rate in samples/s (tqdm's EMA, the plain average)
misses by a wide margin because later samples cost more. Sums decay with time so
recent behaviour weighs more; two half-lives give the band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Sums:
    nn: float = 0.0
    nk: float = 0.0
    kk: float = 0.0
    nt: float = 0.0
    kt: float = 0.0
    tt: float = 0.0
    count: float = 0.0

    def scale(self, f: float) -> None:
        for name in ("nn", "nk", "kk", "nt", "kt", "tt", "count"):
            setattr(self, name, getattr(self, name) * f)


class CostModel:
    """Decayed weighted least squares of interval time on (samples, tokens) done."""

    def __init__(self, *, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.sums = _Sums()
        self.last_t: float | None = None

    def add(self, *, t: float, dt: float, samples: float, tokens: float | None) -> None:
        """Record that `samples` (and `tokens`) took `dt` seconds, ending at time `t`."""
        if self.last_t is not None and t > self.last_t:
            self.sums.scale(0.5 ** ((t - self.last_t) / self.half_life_s))
        self.last_t = t
        k = tokens or 0.0
        s = self.sums
        s.nn += samples * samples
        s.nk += samples * k
        s.kk += k * k
        s.nt += samples * dt
        s.kt += k * dt
        s.tt += dt * dt
        s.count += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(seconds per sample, seconds per token), both ≥ 0, or None before any data."""
        s = self.sums
        if s.count <= 0 or s.nn <= 0:
            return None
        det = s.nn * s.kk - s.nk * s.nk
        # Nearly collinear (all prompts alike): a two-term fit is noise; use one term.
        if s.kk > 0 and det > 1e-6 * s.nn * s.kk:
            a = (s.nt * s.kk - s.kt * s.nk) / det
            b = (s.kt * s.nn - s.nt * s.nk) / det
            if a >= 0 and b >= 0:
                return a, b
            if a < 0:
                return 0.0, max(s.kt / s.kk, 0.0)
        return max(s.nt / s.nn, 0.0), 0.0

    def predict(self, *, samples: float, tokens: float | None) -> float | None:
        """Seconds to process `samples` more (with `tokens` more tokens)."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b = coef
        if b > 0 and tokens is None:
            return None
        return a * samples + b * (tokens or 0.0)


@dataclass(frozen=True)
class Eta:
    """An ETA with its band, in seconds from now."""

    eta_s: float
    low_s: float
    high_s: float


class EtaEstimator:
    """Two cost models (recent and long memory); their spread and the noise make the band.

    From the third interval on there is an ETA; until MIN_INTERVALS its band is wide (the
    noise term shrinks with 1/√n) and may span up to EARLY_BAND_RATIO. After that a band
    wider than MAX_BAND_RATIO means the models disagree too much to be useful: withheld."""

    EARLY_INTERVALS = 3
    MIN_INTERVALS = 20
    MAX_BAND_RATIO = 3.0
    EARLY_BAND_RATIO = 10.0

    def __init__(self, *, short_half_life_s: float = 1200.0, long_half_life_s: float = 7200.0) -> None:
        self.short = CostModel(half_life_s=short_half_life_s)
        self.long = CostModel(half_life_s=long_half_life_s)
        self.intervals = 0

    def add(self, *, t: float, dt: float, samples: float, tokens: float | None) -> None:
        """Feed one interval between progress events."""
        if dt <= 0 or samples <= 0:
            return
        self.short.add(t=t, dt=dt, samples=samples, tokens=tokens)
        self.long.add(t=t, dt=dt, samples=samples, tokens=tokens)
        self.intervals += 1

    def estimate(self, *, samples_left: float, tokens_left: float | None) -> Eta | None:
        """The ETA, or None while the band would be meaningless."""
        if self.intervals < self.EARLY_INTERVALS:
            return None
        if samples_left <= 0:
            return Eta(0.0, 0.0, 0.0)
        short = self.short.predict(samples=samples_left, tokens=tokens_left)
        long = self.long.predict(samples=samples_left, tokens=tokens_left)
        if short is None or long is None or short <= 0 or long <= 0:
            return None
        eta = 0.7 * short + 0.3 * long
        noise = 1.0 + 2.0 / math.sqrt(self.intervals)
        low, high = min(short, long) / noise / 1.05, max(short, long) * noise * 1.05
        cap = self.EARLY_BAND_RATIO if self.intervals < self.MIN_INTERVALS else self.MAX_BAND_RATIO
        if high / max(low, 1e-9) > cap:
            return None
        return Eta(eta, low, high)
