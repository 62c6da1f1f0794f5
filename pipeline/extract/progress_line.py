"""Progress lines on stderr for a person: rate and ETA, at most one every few seconds."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    """Counts samples and prints `extract: N / T (p %), r samples/s, ETA …` now and then."""

    def __init__(self, *, total: int, done: int, tokens_total: int, log=sys.stderr, every_s: float = 5.0) -> None:
        self.total, self.done, self.failed, self.tokens = total, done, 0, 0
        self.tokens_total, self.log, self.every_s = tokens_total, log, every_s
        self.start, self.start_done, self.last = time.monotonic(), done, 0.0

    def add(self, *, ok: bool, tokens: int) -> None:
        """Count one finished sample."""
        if ok:
            self.done += 1
        else:
            self.failed += 1
        self.tokens += tokens
        if time.monotonic() - self.last >= self.every_s:
            self.print()

    def print(self) -> None:
        """Print one line now."""
        self.last = time.monotonic()
        elapsed = max(1e-9, self.last - self.start)
        n = self.done + self.failed - self.start_done
        rate = n / elapsed
        left = self.total - self.done - self.failed
        eta = f"{left / rate / 60:.0f} min" if rate > 0 else "unknown"
        pct = 100.0 * (self.done + self.failed) / self.total if self.total else 100.0
        print(f"extract: {self.done + self.failed:,} / {self.total:,} ({pct:.1f} %), {rate:.2f} samples/s, "
              f"{self.tokens / elapsed:,.0f} tokens/s, ETA {eta}, failed {self.failed}", file=self.log, flush=True)

    def final(self) -> None:
        """The closing line."""
        self.print()
