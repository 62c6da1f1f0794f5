"""Verdicts, their thresholds, and the small evidence helpers diagnosis uses."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    """A stage's verdict. A str: it compares, prints and serialises as its value ("stalled")."""

    STARTING = "starting"
    PROGRESSING = "progressing"
    SLOW = "slow"
    STALLED = "stalled"
    STOPPED = "stopped"
    DEAD = "dead"
    DONE = "done"
    UNKNOWN = "unknown"

    @property
    def stuck(self) -> bool:
        """Stalled or dead: what pages the on-call (never slow, unknown or a requested stop)."""
        return self in (Verdict.STALLED, Verdict.DEAD)

    @property
    def working(self) -> bool:
        """Doing its work: a stuck stage that becomes one of these has recovered."""
        return self in (Verdict.STARTING, Verdict.PROGRESSING, Verdict.SLOW)

    @classmethod
    def of(cls, value) -> Verdict | None:
        """The verdict a stored string names; None for anything else (a missing or older record)."""
        try:
            return cls(value)
        except ValueError:
            return None


VERDICTS = tuple(v.value for v in Verdict)


@dataclass(frozen=True)
class Policy:
    """Thresholds; the defaults are the documented behaviour."""

    stall_floor_s: float = 60.0  # never call a stall sooner than this
    gap_multiplier: float = 3.0  # deadline = max(floor, multiplier × p99 of the stage's own gaps)
    ceiling_s: float = 1800.0  # signs of work hold a stall off at most this long
    startup_window_s: float = 600.0  # time allowed before the first progress
    max_failed_share: float = 0.001
    slow_ratio: float = 2.5  # recent work took this many times longer than the baseline predicts
    slow_window_s: float = 600.0
    baseline_window_s: float = 3600.0
    activity_window_s: float = 60.0
    cpu_busy_share: float = 0.25  # of one core
    # Signs of work seen this recently still count: the tick after a giant prefill, the GPUs have just
    # gone quiet while the client receives and parses the answer (a burst of CPU in the last tick that
    # the activity window's average dilutes). Short enough that a wedged server (GPUs idle since its
    # last progress) is still flagged at the stall floor.
    recent_activity_s: float = 30.0
    # A process in uninterruptible sleep after writing (an fsync, a flush to a network filesystem: the quiet
    # after a checkpoint write) is working for at most this long with nothing written; past it, a hung
    # filesystem. Without a write since the last progress that sleep is no sign of work (a stuck driver).
    disk_wait_s: float = 300.0


@dataclass(frozen=True)
class VerdictRecord:
    """The diagnosis of one stage at time t."""

    t: float
    stage: str
    verdict: Verdict
    reasons: tuple[str, ...] = ()
    progress_pct: float | None = None
    eta_s: float | None = None
    eta_low_s: float | None = None
    eta_high_s: float | None = None
    done: int | None = None
    failed: int | None = None
    total: int | None = None
    rate_samples_per_s: float | None = None
    rate_tokens_per_s: float | None = None
    last_progress_at: float | None = None
    deadline_s: float | None = None
    eta_note: str | None = None  # why there is no ETA (not part of the replay contract)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))  # a name that is no verdict raises here

    @property
    def stuck(self) -> bool:
        """True for stalled and dead only."""
        return self.verdict.stuck

    def replay_json(self) -> dict:
        """The object `eagle3 diagnose --replay --json` prints."""
        r = lambda v, nd=1: None if v is None else round(v, nd)  # noqa: E731
        return {"t": self.t, "stage": self.stage, "verdict": self.verdict, "stuck": self.stuck,
                "progress_pct": r(self.progress_pct, 2), "eta_s": r(self.eta_s), "eta_low_s": r(self.eta_low_s),
                "eta_high_s": r(self.eta_high_s), "reasons": list(self.reasons)}


@dataclass(frozen=True)
class StoredVerdict(VerdictRecord):
    """A stage's verdict as the store keeps it each tick: the diagnosis (`VerdictRecord`'s fields) and which
    process and run it is of, and whether that process had ended (`final`). Written by the sampler (`of`), read
    back by the store (`from_json`); everyone reads fields by attribute."""

    proc_id: int | None = None
    run: str | None = None
    final: bool = False

    STATUS_FIELDS = ("stuck", "progress_pct", "eta_s", "eta_low_s", "eta_high_s", "done", "failed", "total",
                     "rate_samples_per_s", "rate_tokens_per_s", "last_progress_at", "eta_note")

    @staticmethod
    def of(v: VerdictRecord, *, proc_id: int, run: str | None, final: bool) -> StoredVerdict:
        return StoredVerdict(**{k: getattr(v, k) for k in VerdictRecord.__dataclass_fields__}, proc_id=proc_id,
                             run=run, final=final)

    @staticmethod
    def from_json(d: dict | None) -> StoredVerdict | None:
        """The record from the store's JSON (keys it does not know, `stuck` among them, are ignored), or None."""
        if not isinstance(d, dict):
            return None
        known = {k: d[k] for k in StoredVerdict.__dataclass_fields__ if k in d}
        known.setdefault("t", None)
        known.setdefault("stage", None)
        known["verdict"] = known.get("verdict") or Verdict.UNKNOWN
        known["reasons"] = tuple(known.get("reasons") or ())
        known["final"] = bool(known.get("final"))
        return StoredVerdict(**known)

    def to_json(self) -> dict:
        return {**{k: (list(v) if k == "reasons" else v) for k, v in self.__dict__.items()}, "stuck": self.stuck}


def num(d: dict | None, key: str) -> float | None:
    if not isinstance(d, dict):
        return None
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def fmt_s(seconds: float) -> str:
    """Seconds as '3m12s' or '2h05m' for reasons."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_bytes(n: float) -> str:
    """Bytes as '512 B', '3.2 MB', '1.50 GB' (decimal units, as disks and budgets are given)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("TB", "GB") else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def gpu_busy_at_power(g: dict) -> bool:
    util, power, limit = num(g, "util"), num(g, "power_w"), num(g, "power_limit_w")
    if util is None or power is None:
        return False
    return util >= 50 and power >= (0.5 * limit if limit else 150.0)


def gpu_pinned_low_power(g: dict) -> bool:
    # Ranks deadlocked in a collective spin at ~100 % "utilization" while drawing little power.
    util, power, limit = num(g, "util"), num(g, "power_w"), num(g, "power_limit_w")
    if util is None or power is None:
        return False
    return util >= 95 and power < (0.3 * limit if limit else 120.0)


def gpu_indices(gpus: list[dict]) -> str:
    return ",".join(str(g.get("index", "?")) for g in gpus)
