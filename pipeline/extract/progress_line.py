"""Progress lines on stderr for a person: rate and ETA, at most one every few seconds.

The ETA is the monitor's own estimator (pipeline.observe.eta), fed the same kind of intervals:
one run shows one ETA in its log, in `eagle3 status` and in Slack.
"""

from __future__ import annotations

import sys
import time

from pipeline.observe.eta import EtaEstimator
from pipeline.observe.latency import LatencyProfile
from pipeline.verdict import fmt_s


class ProgressLine:
    """Counts samples and prints `extract: N / T (p %), r samples/s, ETA …` now and then."""

    def __init__(self, *, total: int, done: int, tokens_total: int, tokens_left: int | None = None,
                 tokens_sq_left: int | None = None, log=sys.stderr,
                 every_s: float = 5.0, clock=time.monotonic) -> None:
        self.total, self.done, self.failed, self.tokens = total, done, 0, 0
        self.tokens_total, self.log, self.every_s, self.clock = tokens_total, log, every_s, clock
        self.tokens_left, self.tokens_sq_left, self.tokens_sq = tokens_left, tokens_sq_left, 0
        self.start, self.start_done, self.last = clock(), done, 0.0
        self.eta = EtaEstimator()
        self.mark = (self.start, done, 0, 0)  # (time, processed, tokens, Σtokens²) at the last interval's end
        self.latencies = LatencyProfile()  # the samples' since the last interval's end, as the manifest keeps them

    def add(self, *, ok: bool, tokens: int, latency_s: float | None = None) -> None:
        """Count one finished sample (a done one with its request's latency, when known)."""
        if ok and latency_s is not None and tokens > 0:
            self.latencies += LatencyProfile.one(tokens, latency_s)
        if ok:
            self.done += 1
        else:
            self.failed += 1
        self.tokens += tokens
        self.tokens_sq += tokens * tokens
        if self.tokens_left is not None:
            self.tokens_left -= tokens
        if self.tokens_sq_left is not None:
            self.tokens_sq_left -= tokens * tokens
        if self.clock() - self.last >= self.every_s:
            self.print()

    def _feed(self, now: float) -> None:
        t0, n0, k0, q0 = self.mark
        processed = self.done + self.failed
        if processed > n0 and now > t0:
            self.eta.add(t=now, dt=now - t0, samples=processed - n0, tokens=self.tokens - k0,
                         tokens_sq=None if self.tokens_sq_left is None else self.tokens_sq - q0,
                         latency=self.latencies)
            self.mark = (now, processed, self.tokens, self.tokens_sq)
            self.latencies = LatencyProfile()

    def eta_text(self) -> str:
        """'ETA 4h 48m (4h 10m–5h 30m)', or why there is none yet."""
        left = self.total - self.done - self.failed
        est = self.eta.estimate(samples_left=left, tokens_left=self.tokens_left, tokens_sq_left=self.tokens_sq_left)
        if est is None:
            return f"no ETA yet ({self.eta.why})" if self.eta.why else "ETA not yet meaningful"
        return f"ETA {fmt_s(est.eta_s)} ({fmt_s(est.low_s)}–{fmt_s(est.high_s)})"

    def print(self) -> None:
        """Print one line now."""
        self.last = self.clock()
        self._feed(self.last)
        elapsed = max(1e-9, self.last - self.start)
        rate = (self.done + self.failed - self.start_done) / elapsed
        pct = 100.0 * (self.done + self.failed) / self.total if self.total else 100.0
        print(f"extract: {self.done + self.failed:,} / {self.total:,} ({pct:.1f} %), {rate:.2f} samples/s, "
              f"{self.tokens / elapsed:,.0f} tokens/s, {self.eta_text()}, failed {self.failed}", file=self.log,
              flush=True)

    def final(self) -> None:
        """The closing line."""
        self.print()
