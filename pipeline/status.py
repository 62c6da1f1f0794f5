"""The read model: the status the controller hands to the CLI, Slack and the metrics, as typed snapshots.

`RunStatus.to_json()` is the `eagle3 status --json` contract, key for key: a stage never started
carries only its process fields; a started one adds `stop_requested` and its verdict fields (four
while no verdict of this process is stored yet, all of them once one is). Readings the verdict
quotes (`gpus`, `server`, `disk`, `progress`) stay in the observation format (dicts whose fields may
be missing): they are the spine's, documented in docs/architecture.md. Unknown is None, never zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.states import MAYBE_ALIVE_STATES, HandoffState, HandoffStep, StageState, StateVersion
from pipeline.verdict import StoredVerdict, Verdict

PROCESS_KEYS = ("state", "pid", "exit_code", "signal", "started_at", "ended_at", "uptime_s", "log", "reason", "run")
UNOBSERVED_KEYS = ("verdict", "progress_pct", "eta_s", "reasons")
# the stored verdict's fields status shows (StoredVerdict declares them), in the JSON's order
VERDICT_KEYS = ("verdict", *StoredVerdict.STATUS_FIELDS[:5], "reasons", *StoredVerdict.STATUS_FIELDS[5:])
READING_KEYS = ("gpus", "server", "disk", "progress")


@dataclass(frozen=True)
class StageStatus:
    """One stage: its latest process (None fields before any) and, once observed, its verdict."""

    state: StageState
    log: str
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    started_at: float | None = None  # unix seconds
    ended_at: float | None = None
    uptime_s: float | None = None  # while running
    reason: str | None = None  # how it ended, or why it is unknown
    run: str | None = None
    stop_requested: bool = False
    job: str | None = None  # the Slurm job id of a stage run as a job (the key is absent for local stages)
    nodes: str | None = None  # the job's nodes as Slurm lists them ("gpu-[017-018]"), once it runs (else absent)
    # where a Slurm job's processes were last read and how ({"via": "srun --overlap on gpu-017", "age_s": 3.0}: the
    # reading's age at the observation); absent for a local stage
    read: dict | None = None
    out: str | None = None  # its output as its run sees it (`{run}` expanded); the key is absent where none is set
    observed: bool = False  # a verdict of this very process is stored (else: "not observed yet")
    # the stored verdict of this process (its fields are StoredVerdict's, declared there once and read here as
    # attributes: st.eta_s, st.progress_pct …); before one is stored, what is said instead ("just started"); None:
    # never started
    diagnosis: StoredVerdict | None = None
    gpus: list[dict] | None = None
    server: dict | None = None
    disk: dict | None = None
    progress: dict | None = None
    gaps: dict | None = None  # why a reading is missing ({"gpus": "NVML not available: …"}); not in the JSON

    def __getattr__(self, name: str) -> Any:
        """The stored verdict's status fields (`StoredVerdict.STATUS_FIELDS`), None where there is none."""
        if name in StoredVerdict.STATUS_FIELDS:
            return getattr(self.diagnosis, name) if self.diagnosis is not None else None
        raise AttributeError(name)

    @property
    def verdict(self) -> Verdict | None:
        """None: never started."""
        return self.diagnosis.verdict if self.diagnosis is not None else None

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.diagnosis.reasons if self.diagnosis is not None else ()

    @property
    def observed_at(self) -> float | None:
        return self.diagnosis.t if self.observed and self.diagnosis is not None else None

    @property
    def started(self) -> bool:
        """A process was ever started for this stage in the workspace."""
        return self.state != StageState.NOT_STARTED

    @property
    def running(self) -> bool:
        return self.state == StageState.RUNNING

    @property
    def maybe_alive(self) -> bool:
        """Its process may still run (queued, running, or unknown): there is something to stop."""
        return self.state in MAYBE_ALIVE_STATES

    @property
    def processed(self) -> int | None:
        """Samples (or steps) done and failed; None while unknown."""
        return None if self.done is None else self.done + (self.failed or 0)

    def to_json(self) -> dict[str, Any]:
        """This stage in `status --json`, with exactly the keys of its branch."""
        out = {k: _plain(getattr(self, k)) for k in PROCESS_KEYS}
        if self.job is not None:
            out["job"] = self.job
        if self.nodes is not None:
            out["nodes"] = self.nodes
        if self.read is not None:
            out["read"] = self.read
        if self.out is not None:
            out["out"] = self.out
        if not self.started:
            return out
        out["stop_requested"] = self.stop_requested
        keys = VERDICT_KEYS + ("observed_at",) + READING_KEYS if self.observed else UNOBSERVED_KEYS
        out.update({k: _plain(getattr(self, k)) for k in keys})
        return out

    @classmethod
    def from_json(cls, obj: dict) -> StageStatus:
        """A stage as `to_json` wrote it (a recorded status, a test's fixture)."""
        known = {f.name for f in fields(cls)} - {"diagnosis", "observed"}
        values = {k: v for k, v in obj.items() if k in known}
        values["state"] = StageState(values["state"])
        values.setdefault("log", "")
        values["observed"] = "observed_at" in obj
        if any(obj.get(k) is not None for k in VERDICT_KEYS):  # its verdict, as written
            values["diagnosis"] = StoredVerdict.from_json({**obj, "t": obj.get("observed_at"), "stage": None,
                                                           "verdict": Verdict.of(obj.get("verdict")) or Verdict.UNKNOWN})
        return cls(**values)


@dataclass(frozen=True)
class RunStatus:
    """The whole workspace: the run, the monitor, auto-start, Slack delivery and every stage."""

    run: str | None
    stages: dict[str, StageStatus]
    monitor: str = "not running"  # or "running"
    autostart: str = "off"  # "off" or the handoff's step
    autostart_reason: str | None = None
    handoff: HandoffStep | None = None  # the handoff's step, typed (`autostart` is how the JSON shows it)
    outbox: dict = field(default_factory=dict)  # pending, failed, last_error
    transport: dict | None = None  # how serve receives Slack's commands, while it runs
    slack_auth: dict | None = None
    config_changed: dict | None = None  # the config file no longer reads as serve started with it {t, error, file}
    version: StateVersion | None = None  # what a button rendered from this status is against (not in the JSON)

    @property
    def autostart_cancellable(self) -> bool:
        """A handoff before its training exists: a Cancel button means something."""
        return self.handoff is not None and self.handoff.cancellable

    def started(self) -> dict[str, StageStatus]:
        """The stages that were ever started, in pipeline order."""
        return {n: st for n, st in self.stages.items() if st.started}

    def first_gpus(self) -> list[dict] | None:
        """The first stage's GPU reading (they all read the same GPUs)."""
        return next((st.gpus for st in self.stages.values() if st.gpus), None)

    def gpus_gap(self) -> str | None:
        """Why there is no GPU reading: the probe's own reason, or that no stage is being observed."""
        observed = [st for st in self.stages.values() if st.observed]
        if not observed:
            return "nothing is observed yet: no stage has been started, or `eagle3 serve` is not running"
        return next(((st.gaps or {}).get("gpus") for st in observed if (st.gaps or {}).get("gpus")), None)

    def to_json(self) -> dict[str, Any]:
        """`eagle3 status --json`."""
        out = {"run": self.run, "monitor": self.monitor, "autostart": self.autostart,
               "autostart_reason": self.autostart_reason, "outbox": self.outbox, "transport": self.transport,
               "slack_auth": self.slack_auth, "stages": {n: st.to_json() for n, st in self.stages.items()}}
        if self.config_changed:  # the key is absent while the file reads as serve started with it
            out["config_changed"] = self.config_changed
        return out

    @classmethod
    def from_json(cls, obj: dict) -> RunStatus:
        """A status as `to_json` wrote it; missing keys take their defaults."""
        known = {f.name for f in fields(cls)} - {"stages", "handoff", "version"}
        shown = obj.get("autostart")
        step = HandoffStep(shown) if shown in {str(s) for s in HandoffStep} else None  # "off": none, or cancelled
        return cls(stages={n: StageStatus.from_json(st) for n, st in (obj.get("stages") or {}).items()}, handoff=step,
                   **{k: v for k, v in obj.items() if k in known})


def _plain(value):
    """JSON's value: tuples as lists (enums are str already)."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class AutostartResult:
    """What `autostart on|off` did: whether the handoff changed, the handoff now, and whether a monitor runs to
    advance it."""

    on: bool
    changed: bool
    state: HandoffState | None
    monitor_running: bool

    @property
    def refused(self) -> bool:
        """`autostart off` could not do what was asked: training already runs (the CLI exits 2)."""
        return not self.on and not self.changed and self.state is not None and self.state.step is HandoffStep.TRAINING
