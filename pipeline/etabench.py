"""Scoring of ETA estimators on simulated traces (used by tests and `make bench`)."""

from __future__ import annotations

from pipeline.diagnosis import Diagnoser
from pipeline.simtrace import Trace

CHECKPOINTS = (10, 25, 50, 75)


class EmaRate:
    """tqdm-style: an exponential moving average of the per-tick rate (smoothing 0.3)."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing, self.rate, self.last = smoothing, None, None

    def eta(self, t: float, processed: float, total: float) -> float | None:
        if self.last is not None and t > self.last[0]:
            r = (processed - self.last[1]) / (t - self.last[0])
            self.rate = r if self.rate is None else self.smoothing * r + (1 - self.smoothing) * self.rate
        self.last = (t, processed)
        return (total - processed) / self.rate if self.rate else None


class AverageRate:
    """Elapsed time per sample so far, times the samples left."""

    def __init__(self) -> None:
        self.t0 = None

    def eta(self, t: float, processed: float, total: float) -> float | None:
        self.t0 = self.t0 if self.t0 is not None else t
        return (total - processed) * (t - self.t0) / processed if processed else None


def eta_errors(trace: Trace) -> dict[str, dict[int, float | None]]:
    """Relative ETA error (|estimate − truth| / truth) at each progress checkpoint, per estimator;
    under "band", whether eagle3's band held the truth."""
    t_start = trace.observations[0]["t"] - trace.scenario.tick_s
    finish = t_start + trace.finish_s
    diag, ema, avg = Diagnoser(stage=trace.scenario.stage), EmaRate(), AverageRate()
    avg.t0 = t_start
    out = {"eagle3": {}, "tqdm-ema": {}, "average-rate": {}, "band": {}}
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
            for name, est in estimates.items():
                out[name][cp] = None if est is None or truth <= 0 else abs(est - truth) / truth
            # 1.0 when the band holds the truth, 0.0 when not, None when withheld
            out["band"][cp] = None if v.eta_low_s is None else float(v.eta_low_s <= truth <= v.eta_high_s)
    return out
