"""Scoring of ETA estimators on simulated traces (used by tests and `make bench`)."""

from __future__ import annotations

from pipeline.observe.diagnosis import Diagnoser
from pipeline.toy.simtrace import Trace

CHECKPOINTS = (10, 25, 50, 75)


class EmaRate:
    """tqdm-style: an exponential moving average of the per-tick rate (smoothing 0.3)."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing = smoothing
        self.rate: float | None = None
        self.last: tuple[float, float] | None = None

    def eta(self, t: float, processed: float, total: float) -> float | None:
        if self.last is not None and t > self.last[0]:
            r = (processed - self.last[1]) / (t - self.last[0])
            self.rate = r if self.rate is None else self.smoothing * r + (1 - self.smoothing) * self.rate
        self.last = (t, processed)
        return (total - processed) / self.rate if self.rate else None


class AverageRate:
    """Elapsed time per sample so far, times the samples left."""

    def __init__(self) -> None:
        self.t0: float | None = None

    def eta(self, t: float, processed: float, total: float) -> float | None:
        t0 = self.t0 = self.t0 if self.t0 is not None else t
        return (total - processed) * (t - t0) / processed if processed else None


def oracle_eta(trace: Trace, processed: int) -> float | None:
    """A reference no aggregate estimator has: a + b·tokens + c·tokens² fitted to every finished sample's
    own duration (weighted by the true noise, which is multiplicative), summed over exactly the samples
    left. What it misses is what the durations seen so far cannot tell about the ones to come."""
    import numpy as np

    sc = trace.scenario
    n = np.array([w[0] for w in trace.work], dtype=float)
    d = np.array([w[1] for w in trace.work], dtype=float)
    if processed < 3 or processed >= len(n):
        return None
    x = np.stack([np.ones_like(n), n, n * n], axis=1)
    w = 1.0 / (sc.overhead_s + sc.per_token_s * n[:processed] + sc.per_token2_s * n[:processed] ** 2)
    beta = np.linalg.lstsq(x[:processed] * w[:, None], d[:processed] * w, rcond=None)[0]
    return float((x[processed:] @ beta).sum())


def eta_errors(trace: Trace) -> dict[str, dict[int, float | None]]:
    """Relative ETA error (|estimate − truth| / truth) at each progress checkpoint, per estimator;
    under "band", whether eagle3's band held the truth; "oracle" is `oracle_eta`."""
    t_start = trace.observations[0]["t"] - trace.scenario.tick_s
    finish = t_start + trace.finish_s
    diag, ema, avg = Diagnoser(stage=trace.scenario.stage), EmaRate(), AverageRate()
    avg.t0 = t_start
    out: dict[str, dict] = {"eagle3": {}, "tqdm-ema": {}, "average-rate": {}, "oracle": {}, "band": {}}
    pending = list(CHECKPOINTS)
    for obs in trace.observations:
        v = diag.feed(obs)
        prog = obs["progress"]
        processed, total = prog["done"] + prog["failed"], prog["total"]
        estimates = {"eagle3": v.eta_s, "tqdm-ema": ema.eta(obs["t"], processed, total),
                     "average-rate": avg.eta(obs["t"], processed, total)}
        pct = 100.0 * processed / total
        while pending and pct >= pending[0]:
            cp = pending.pop(0)
            truth = finish - obs["t"]
            if trace.work:
                estimates["oracle"] = oracle_eta(trace, int(processed))
            for name, est in estimates.items():
                out[name][cp] = None if est is None or truth <= 0 else abs(est - truth) / truth
            # 1.0 when the band holds the truth, 0.0 when not, None when withheld
            out["band"][cp] = None if v.eta_low_s is None else float(v.eta_low_s <= truth <= v.eta_high_s)
    return out
