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
cannot be negative; `pipeline/observe/costfit.py`). Sums decay with
time so recent behaviour weighs more; two half-lives give the band.

Where the stage also reports its requests' own latencies (the extraction does: progress field
`latency_moments`, see `pipeline/observe/latency.py`), the *shape* of the cost — how much more a long prompt
costs than a short one — is fitted to every sample's own latency instead of to span sums, which
blur it (a span holds a dozen samples of similar length; on data sorted into length buckets the
spans cannot tell a from b from c). The wall clock then gives the *scale*: wall seconds per
latency second over recent spans (1 with one request at a time; about 1/concurrency when a
continuous-batching server shares its GPUs among the requests in flight, under which a request's
expected latency is proportional to its own cost).

Where the stage reports neither (only done/total/tokens), a span's Σtokens² is its progress intervals'
tokens² / samples plus how much prompts differ within an interval, estimated from consecutive intervals'
mean lengths (`EtaEstimator._within`) — not as if the span's prompts were alike, which on a length
bucket that holds prompts from 1,300 to 3,300 tokens read their cost per token² high — and the work
left's is estimated in the same units (`EtaEstimator._sq_left_range`): on length-sorted data from its
mean and the current length; on unsorted data (buckets in random order, shuffled) between spread as
within the spans seen and as spread as the spans seen so far. Its bounds widen the band, each
taken with every curvature the spans allow (below).

Where the spans cannot tell the cost's curvature — two or three length levels seen, as at a quarter of
data sorted into length buckets, which a line and a parabola fit alike — the estimate is the geometric
centre of the non-negative fits they cannot tell from the best (`CostModel.predict_range`), and the band
spans them: "4–7 h" rather than whichever extrapolation the noise favours. On token counts alone the spans'
Σtokens² are estimates, and "cannot tell" is judged with a wider tolerance (`PROFILE_KAPPA_ESTIMATED`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from pipeline.observe.costfit import PROFILE_KAPPA_ESTIMATED, CostModel
from pipeline.observe.latency import LatencyProfile, LatencyShape
from pipeline.verdict import fmt_s


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
    # With token counts alone, a span holds at least this many samples (up to SPAN_LONGEST_S): a span of
    # a few long samples has its time cut mid-sample at both ends and its Σtokens² taken as if its
    # prompts were alike, which blurs how much they cost (the quadratic term comes out attenuated on long,
    # varied prompts). Where Σtokens² is reported, spans close on time alone, for an early first ETA.
    SPAN_MIN_SAMPLES, SPAN_LONGEST_S = 25, 900.0
    EXTRAPOLATION_LIMIT = 3.5  # the prompts left may be this much longer than the longest span's
    # From a quarter of the work on an estimate is always given: "4–7 h" is an answer, "unknown" is not
    # (the seed's operator asked at 49 %). Before it, a guess may still be withheld, with its reason.
    ANSWER_FROM_SHARE = 0.25
    TREND_RANK = 0.6  # |rank correlation| of the spans' lengths with time from which data count as sorted
    SPREAD_BOUND = 2.0  # Σtokens² · n / (Σtokens)² of the prompts left at most: a coefficient of variation of 1
    # ... and where the spans' mean lengths differ far more (UNSEEN_RATIO×) than prompts within one do and in
    # no order by length (buckets in random order), lengths not seen yet may be left: a CV² of 2. Chats with a
    # share of long documents (the benchmark's two-mode mix) leave a CV² of 0.9–2.2 at a quarter of the way.
    SPREAD_BOUND_UNSEEN, UNSEEN_RATIO = 3.0, 10.0
    MIN_LATENCY_SAMPLES = 50
    WITHIN_PAIRS = 15  # consecutive intervals whose mean lengths' differences give the spread within one
    CHI2_1_MEDIAN = 0.4549  # the median of χ² with one degree of freedom
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
        self.span_lengths: list[tuple[float, float]] = []  # each span's (samples, mean prompt length)
        self._order: tuple[float | None, float] | None = None  # (_trend(), spans' CV²) until the next span
        # How much the prompts within one progress interval differ from one another, from consecutive
        # intervals' mean lengths (`_within`): a span's Σtokens² is then its intervals' tokens² / samples
        # plus that spread, not as if its prompts were alike
        self._last_mean: tuple[float, float] | None = None  # the previous interval's (samples, mean length)
        self._pairs: deque[float] = deque(maxlen=self.WITHIN_PAIRS)
        self._within_sums = [0.0, 0.0]  # Σ samples·(within-span CV²), Σ samples: the run's average
        self._unseen = False  # the work left may hold lengths not seen yet (`_sq_left_range`)

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
        o[3] += tokens_sq if tokens_sq is not None else self._within(samples, tokens)
        self._has = [self._has[0] and tokens is not None, self._has[1] and tokens_sq is not None]
        span = min(self.SPAN_MAX_S, max(self.SPAN_MIN_S, (t - self.first_t) / self.SPANS_PER_RUN))
        proxied = self._has[0] and not self._has[1]  # token counts without Σtokens²
        whole = not proxied or o[1] >= self.SPAN_MIN_SAMPLES or o[0] >= self.SPAN_LONGEST_S
        if o[0] >= span and whole:
            k = o[2] if self._has[0] else None
            q = o[3] if self._has[1] else None
            if q is None and k is not None:  # Σtokens² not reported: its intervals' with their spread
                q = o[3]
                self.sq_proxy = True
                self.short.profile_kappa = self.long.profile_kappa = PROFILE_KAPPA_ESTIMATED
                if k > 0:
                    self._within_sums[0] += o[1] * max(q * o[1] / (k * k) - 1.0, 0.0)
                    self._within_sums[1] += o[1]
            if k is not None:
                self.recent_length = k / o[1]
                self.span_lengths.append((o[1], k / o[1]))
                self._order = None
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

    def _within(self, samples: float, tokens: float | None) -> float:
        """One interval's Σtokens² where only its samples and tokens are known: n·m² for the mean length m,
        plus (n − 1)·s² for the spread s² of prompts about it. s² / m² is estimated from consecutive
        intervals: their mean lengths differ by (m₁ − m₂)² ≈ s²·(1/n₁ + 1/n₂) when both draw from the same
        prompts (the median of the last WITHIN_PAIRS, so that a jump between length buckets counts for
        little). On length-sorted data it is about 0; on shuffled data the spread of the whole dataset."""
        if tokens is None or samples <= 0:
            return 0.0
        m = tokens / samples
        if self._last_mean is not None and m > 0 and self._last_mean[1] > 0:
            pn, pm = self._last_mean
            self._pairs.append((m - pm) ** 2 / (1.0 / samples + 1.0 / pn) / (m * pm))
        self._last_mean = (samples, m)
        cv2 = statistics.median(self._pairs) / self.CHI2_1_MEDIAN if len(self._pairs) >= 5 else 0.0
        return samples * m * m + (samples - 1.0) * cv2 * m * m

    def add_latency(self, profile: LatencyProfile | None) -> None:
        """Samples' latencies, for the cost's shape only (directly: those finished before the first
        progress event, whose wall time is start-up but whose latencies are their own)."""
        if profile is not None and profile.samples > 0:
            self.shape.add_profile(profile)

    def estimate(self, *, samples_left: float, tokens_left: float | None,
                 tokens_sq_left: float | None = None, done_share: float | None = None) -> Eta | None:
        """The ETA, or None while the band would be meaningless. From ANSWER_FROM_SHARE of the work on
        (`done_share`), an estimate is always given, with a band as wide as what is not known."""
        self.why = None
        answer = done_share is not None and done_share >= self.ANSWER_FROM_SHARE  # never withheld for width
        if self.intervals < self.EARLY_INTERVALS:
            self.why = (f"{self.intervals} span(s) of progress observed since watching began; "
                        f"an ETA needs {self.EARLY_INTERVALS}")
            return None
        if samples_left <= 0:
            return Eta(0.0, 0.0, 0.0)
        if (self.shape.profile.samples >= self.MIN_LATENCY_SAMPLES and tokens_left is not None
                and tokens_sq_left is not None and all(sc.values[0] > 0 for sc in self.scales)):
            return self._by_latency(samples_left, tokens_left, tokens_sq_left, answer=answer)
        sq_range = None
        if tokens_sq_left is None and self.sq_proxy and tokens_left is not None:
            sq_range = self._sq_left_range(samples_left, tokens_left)
            tokens_sq_left = sq_range[1]
        short, long = (self._centred(m, samples_left, tokens_left, tokens_sq_left) for m in (self.short, self.long))
        if short is None or long is None or short[0] <= 0 or long[0] <= 0:
            self.why = "the cost fit has no term for the work left (token counts missing)"
            return None
        eta = 0.5 * short[0] + 0.5 * long[0]
        spread = [*short, *long]
        if sq_range is not None and tokens_left is not None and answer:  # past a quarter: the bounds of what is not known
            k2n = tokens_left * tokens_left / samples_left  # Σtokens² left: all prompts alike …
            bound = self.SPREAD_BOUND_UNSEEN if self._unseen else self.SPREAD_BOUND  # … to CV 1 (or √2)
            sq_range = (min(sq_range[0], k2n), sq_range[1], max(sq_range[2], bound * k2n))
        if sq_range is not None:  # the estimate of Σtokens² left is a guess: its bounds widen the band, with
            # every fit the spans cannot tell apart at each (the curvature unknown and the prompts left unknown)
            for q in (sq_range[0], sq_range[2]):
                for m in (self.short, self.long):
                    spread += [m.predict(samples=samples_left, tokens=tokens_left, tokens_sq=q) or eta,
                               *(m.predict_range(samples=samples_left, tokens=tokens_left, tokens_sq=q) or ())]
        # A fit extrapolated far past the longest prompts seen is a guess, and its standard error
        # (from the same fit) does not know it: seen only 700-token prompts, 3,000-token ones to come.
        ahead = (math.sqrt(tokens_sq_left / samples_left) if tokens_sq_left is not None
                 else (tokens_left / samples_left if tokens_left is not None else None))
        if ahead is not None and self.widest > 0 and ahead > self.EXTRAPOLATION_LIMIT * self.widest and not answer:
            self.why = (f"withheld: the prompts left are {ahead / self.widest:.1f}× longer than any seen so far "
                        f"(typical {ahead:,.0f} tokens against {self.widest:,.0f}); the cost fit would be a guess "
                        f"until the work reaches longer prompts")
            return None
        # the band: the two memories' spread, and two standard errors of the long fit's prediction
        sd = self.long.predict_sd(samples=samples_left, tokens=tokens_left, tokens_sq=tokens_sq_left) or 0.0
        return self._banded(eta, spread, 2 * sd, answer=answer)

    @staticmethod
    def _centred(model: CostModel, n: float, k: float | None, q: float | None) -> tuple[float, ...] | None:
        """(estimate, lowest, highest) of one memory's prediction. Where the spans cannot tell the cost's
        curvature (two or three length buckets seen: a line and a parabola fit them alike), the estimate
        is the geometric centre of the fits they cannot tell apart (`CostModel.predict_range`), the
        point whose worst error over that range is smallest in ratio, rather than whichever the noise
        favours; where they can, the range is narrow and its centre the best fit."""
        best = model.predict(samples=n, tokens=k, tokens_sq=q)
        if best is None:
            return None
        rng = model.predict_range(samples=n, tokens=k, tokens_sq=q)
        if rng is None or rng[0] <= 0:
            return (best,)
        return (math.sqrt(rng[0] * rng[1]), *rng)

    def _sq_left_range(self, n: float, k: float) -> tuple[float, float, float]:
        """(low, estimate, high) of Σtokens² over the work left when the stage does not report it. At
        least k² / n (all prompts alike); the prompts left are taken to differ within a span as much as
        those seen did on average (`_within`). On length-sorted data (the spans' lengths rank with time, and
        the prompts left are longer — or shorter — still) the prompts left spread from
        the current length to beyond their mean as an exponential tail would, which on lognormal lengths
        sorted ascending comes within 5 % of the truth from 10 % to 75 % progress; shorter prompts to come
        (sorted descending): alike at best, spread as far as the current length at worst. On unsorted data
        (buckets in random order, shuffled) the prompts left spread about their mean at most as the spans
        seen spread about theirs (fewer buckets left spread less), and the estimate is the centre between.
        Where the spans differ far beyond how prompts within one do (buckets, not shuffled prompts), lengths
        not seen yet may be left, and past a quarter the band's top allows them (SPREAD_BOUND_UNSEEN)."""
        mean = k / n
        floor = k * k / n
        current = self.recent_length or mean
        spread = n * (mean - current) ** 2
        if self._order is None:
            self._order = self._trend(), self._spread()
        trend, cv2 = self._order
        # sorted ascending: the spans' lengths rise and the prompts left are longer still; descending:
        # the reverse. Anything else (buckets in random order, shuffled data) is unordered.
        ordered = trend is None or (trend >= self.TREND_RANK and mean >= current) or (
            trend <= -self.TREND_RANK and mean <= current)
        # the prompts left spread within a span as those seen did on average
        within = self._within_sums[0] / self._within_sums[1] if self._within_sums[1] > 0 else 0.0
        base = floor * (1.0 + within)
        samples = sum(c for c, _ in self.span_lengths)
        self._unseen = not ordered and cv2 * samples / max(len(self.span_lengths), 1) > self.UNSEEN_RATIO * within
        if not ordered:
            # no order by length (buckets in random order, shuffled data): and about their mean as much as
            # the spans seen so far spread about theirs, at most
            high = base * (1.0 + cv2)
            return floor, math.sqrt(base * high), high
        # sorted (or in length buckets, which are shuffled inside): and over their lengths to come
        if mean < current:  # shorter prompts to come (sorted descending): no tail beyond
            return floor, base, base + spread
        return floor, base + spread, base + 2 * spread

    def _spread(self) -> float:
        """The spans' mean lengths' squared coefficient of variation, weighted by their samples."""
        w = sum(c for c, _ in self.span_lengths)
        if w <= 0:
            return 0.0
        mu = sum(c * m for c, m in self.span_lengths) / w
        return sum(c * (m - mu) ** 2 for c, m in self.span_lengths) / w / (mu * mu) if mu > 0 else 0.0

    def _trend(self) -> float | None:
        """Spearman's rank correlation of the spans' mean lengths with time (None before 3 spans)."""
        means = [m for _, m in self.span_lengths]
        if len(means) < 3:
            return None
        ranks = [0.0] * len(means)
        for r, i in enumerate(sorted(range(len(means)), key=means.__getitem__)):
            ranks[i] = float(r)
        n = len(means)
        mid = (n - 1) / 2
        num = sum((r - mid) * (i - mid) for i, r in enumerate(ranks))
        den = sum((i - mid) ** 2 for i in range(n))
        return num / den

    def _by_latency(self, n: float, k: float, q: float, *, answer: bool) -> Eta | None:
        """The latency path: Σ of each remaining sample's fitted latency, times wall seconds per latency
        second (short and long memory); the band adds two standard errors of the fit's sum."""
        lat_left = self.shape.predict(samples=n, tokens=k, tokens_sq=q)
        if not lat_left or lat_left <= 0:
            self.why = "the latency fit has no term for the work left"
            return None
        timed, ahead = self.shape.timed_rms() or 0.0, math.sqrt(q / n)
        if ahead > self.LATENCY_EXTRAPOLATION_LIMIT * timed and not answer:
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
        return self._banded(eta, etas, self.LATENCY_BAND_SD * sd, answer=answer)

    def _banded(self, eta: float, estimates: list[float], margin: float, *, answer: bool) -> Eta | None:
        """The ETA with a band over every estimate and `margin` either side (5 % beyond), or None, with
        why, where the band is too wide to tell anything."""
        low = min(*estimates, eta - margin) / 1.05
        high = max(*estimates, eta + margin) * 1.05
        if low <= 0 and answer:  # the fit's error reaches zero: the lowest estimate bounds it instead
            low = min(e for e in (*estimates, eta) if e > 0) / 1.05
        cap = self.EARLY_BAND_RATIO if self.intervals < self.MIN_INTERVALS else self.MAX_BAND_RATIO
        if low <= 0 or (high / low > cap and not answer):
            self.why = (f"withheld: the work left is unlike the work done so far (e.g. longer prompts to come), "
                        f"so the estimate could be anywhere from {fmt_s(max(low, 0.0))} to {fmt_s(high)}")
            return None
        return Eta(eta, low, high)


class _Decayed:
    """Sums of (seconds, samples, tokens, Σtokens²) over spans, halved every `half_life_s`."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.values: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self.last_t: float | None = None

    def add(self, t: float, row: tuple[float, float, float, float]) -> None:
        f = 0.5 ** ((t - self.last_t) / self.half_life_s) if self.last_t is not None and t > self.last_t else 1.0
        self.last_t = t
        self.values = tuple(v * f + r for v, r in zip(self.values, row, strict=True))
