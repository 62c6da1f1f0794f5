"""Stage process states and the one transition function (stdlib only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import StrEnum


class StageState(StrEnum):
    """The state of a stage, as `eagle3 status` reports it."""

    NOT_STARTED = "not-started"
    QUEUED = "queued"  # a Slurm job waiting for its allocation (never a stall)
    RUNNING = "running"
    EXITED = "exited"
    STOPPED = "stopped"
    UNKNOWN = "unknown"


RUNNING_STATES = frozenset({StageState.RUNNING})
ENDED_STATES = frozenset({StageState.EXITED, StageState.STOPPED})
# A row in these states may still own live processes: never start a second copy.
MAYBE_ALIVE_STATES = frozenset({StageState.QUEUED, StageState.RUNNING, StageState.UNKNOWN})



@dataclass(eq=False)
class StageProc:
    """One stage-process row, as the store returns it: every column declared once, the state typed.

    Mutable in one place only, this module: `transition` moves it (and the store's row) to a new state, and
    `record` writes its other fields on both."""

    id: int
    stage: str
    state: StageState
    run_id: str | None = None
    pid: int | None = None
    pgid: int | None = None
    create_time: float | None = None
    runner_pid: int | None = None
    runner_create_time: float | None = None
    argv: str | None = None  # JSON list
    log: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    stop_requested: int | None = None
    reason: str | None = None
    executor: str | None = None
    job_name: str | None = None
    job_id: str | None = None
    job_host: str | None = None
    # what the cluster said of the job: its JobState at its end, its NodeList, Slurm's requeues of it (Restarts), its
    # time limit, and when that limit ends it (while it runs)
    job_state: str | None = None
    job_nodes: str | None = None
    job_restarts: int | None = None
    job_limit_s: float | None = None
    job_end_at: float | None = None
    # the restart policy's state (on-failure stages): restarts before this process in its line of automatic
    # restarts (a start by hand begins a new line), when it may be restarted after dying (its backoff), and
    # whether the policy gave up (its limit reached)
    restart_count: int | None = None
    restart_due: float | None = None
    restart_given_up: int | None = None
    set_aside: str | None = None  # not stored: where `start train --fresh` moved the earlier training's files
    reopened: str | None = None  # not stored: the closed run `start train` reopened to train on its extraction

    @classmethod
    def from_row(cls, row: dict) -> StageProc:
        values = {k: row[k] for k in COLUMNS & row.keys()}
        values["state"] = StageState(values["state"])
        return cls(**values)

    def to_dict(self) -> dict:
        """The row as JSON-ready values (the state as its string)."""
        out = asdict(self)
        out["state"] = str(self.state)
        return out

    def update(self, **values) -> None:
        """Set fields as `transition` and a re-read row give them (a state as its string too)."""
        for k, v in values.items():
            setattr(self, k, StageState(v) if k == "state" else v)

    @property
    def has_ended(self) -> bool:
        """The process has ended: exited, stopped, or unknown with its end recorded (it vanished)."""
        return self.state in ENDED_STATES or (self.state == StageState.UNKNOWN and bool(self.ended_at))

    @property
    def maybe_alive(self) -> bool:
        """The row may still own live processes: never start a second copy."""
        return self.state in MAYBE_ALIVE_STATES

    @property
    def in_backoff(self) -> bool:
        """Died, and the restart policy will start it again at `restart_due`."""
        return self.has_ended and self.restart_due is not None and not self.restart_given_up

    @property
    def is_job(self) -> bool:
        """The stage is run by Slurm (not the local runner)."""
        return self.executor == "slurm"

    @property
    def launched(self) -> bool:
        """The stage was handed to something that runs it: a pid, or a Slurm job id."""
        return self.pid is not None or bool(self.job_id)

    @property
    def who(self) -> str:
        """`pid 123` or `Slurm job 45`."""
        return f"Slurm job {self.job_id}" if self.is_job else f"pid {self.pid}"


COLUMNS = frozenset(f.name for f in fields(StageProc)) - {"set_aside", "reopened"}


_EDGES = {
    (StageState.RUNNING, StageState.EXITED),  # RUNNING -> EXITED: ended on its own
    (StageState.RUNNING, StageState.STOPPED),  # RUNNING -> STOPPED: ended after a requested stop
    (StageState.RUNNING, StageState.UNKNOWN),  # RUNNING -> UNKNOWN: identity cannot be verified
    (StageState.UNKNOWN, StageState.RUNNING),  # UNKNOWN -> RUNNING: verified again by (pid, create_time)
    (StageState.UNKNOWN, StageState.EXITED),  # UNKNOWN -> EXITED: a late exit record, or confirmed gone
    (StageState.UNKNOWN, StageState.STOPPED),  # UNKNOWN -> STOPPED: stopped by the operator
    (StageState.QUEUED, StageState.RUNNING),  # QUEUED -> RUNNING: Slurm allocated the job
    (StageState.QUEUED, StageState.EXITED),  # QUEUED -> EXITED: failed before it ran (or never submitted)
    (StageState.QUEUED, StageState.STOPPED),  # QUEUED -> STOPPED: cancelled while pending
    (StageState.QUEUED, StageState.UNKNOWN),  # QUEUED -> UNKNOWN: the cluster no longer knows the job
    (StageState.RUNNING, StageState.QUEUED),  # RUNNING -> QUEUED: Slurm requeued the job
    (StageState.UNKNOWN, StageState.QUEUED),  # UNKNOWN -> QUEUED: the cluster answers again
}


def backoff_due(ended_at: float, base_s: float, tries_before: int) -> float:
    """When the next try may start after one that ended at `ended_at`: `base_s`, doubled for each try before it (the
    restart policy's and the handoff's launch attempts' one formula)."""
    return ended_at + base_s * 2 ** tries_before


def record(store, proc: StageProc, **values) -> None:
    """Fields of the process that are not its state (a Slurm job's id and host, a stop asked for, the restart
    policy's backoff), written to its row and to this copy together."""
    store.update_proc(proc.id, **values)
    proc.update(**values)


def transition(store, proc: StageProc, to: StageState, *, reason: str = "", **values) -> None:
    """Move a stage-process row to `to`, asserting the edge and recording an event."""
    frm = proc.state
    if frm == to and not values and (not reason or reason == proc.reason):
        return  # nothing changes (the same state with a new reason updates the reason, without an event)
    if frm != to and (frm, to) not in _EDGES:
        raise AssertionError(f"illegal stage transition {frm} -> {to}")
    with store.atomic():
        store.update_proc(proc.id, state=str(to), reason=reason or proc.reason, **values)
        if frm != to:
            store.add_event(
                kind=f"stage-{to}", run_id=proc.run_id, stage=proc.stage,
                data={"from": str(frm), "reason": reason, **values},
            )
    proc.update(state=to, reason=reason or proc.reason, **values)


def close_run_after_training(store, proc: StageProc, target: StageState) -> None:
    """Training that finished (exit 0, not stopped) ends its run, when that run is still the current
    one. A training stopped on request or failed leaves the run open: `eagle3 start train`, the
    restart policy and the handoff's relaunch resume it within the same run, whose extraction is
    the one training reads (`stop --all` closes a run for good)."""
    if (proc.stage == "train" and target == StageState.EXITED and proc.exit_code == 0
            and proc.run_id == store.current_run()):
        store.close_run(proc.run_id, reason="training finished (exit 0)")


class HandoffStep(StrEnum):
    """A step of the handoff, as stored (kv `handoff`.step) and shown. A str: it compares as its value."""

    ARMED = "armed"
    WAITING = "waiting-for-completion"
    STOPPING = "stopping-server"
    GPU_WAIT = "waiting-for-gpu-release"
    LAUNCHING = "launching-training"
    TRAINING = "training-running"
    TRAINING_DONE = "training-done"
    TRAINING_FAILED = "training-failed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def cancellable(self) -> bool:
        """Before a training process exists the handoff can be cancelled; LAUNCHING included: a
        launch that completes after the cancel is stopped at once (see `_launching`)."""
        return self in (HandoffStep.ARMED, HandoffStep.WAITING, HandoffStep.STOPPING, HandoffStep.GPU_WAIT,
                        HandoffStep.LAUNCHING)

    @property
    def followed(self) -> bool:
        """A step the tick advances (TRAINING: until training ends)."""
        return self.cancellable or self is HandoffStep.TRAINING

    @property
    def final(self) -> bool:
        """The handoff has ended: nothing advances it any more."""
        return not self.followed


ARMED, WAITING, STOPPING, GPU_WAIT, LAUNCHING, TRAINING = (
    HandoffStep.ARMED, HandoffStep.WAITING, HandoffStep.STOPPING, HandoffStep.GPU_WAIT, HandoffStep.LAUNCHING,
    HandoffStep.TRAINING)
FAILED, CANCELLED = HandoffStep.FAILED, HandoffStep.CANCELLED
TRAINING_DONE, TRAINING_FAILED = HandoffStep.TRAINING_DONE, HandoffStep.TRAINING_FAILED
CANCELLABLE = frozenset(s for s in HandoffStep if s.cancellable)
FOLLOWED = frozenset(s for s in HandoffStep if s.followed)
# The handoff's edges, as the stages have theirs (above): the handoff's `_set` refuses any other.
# None is "no handoff of this run" (off, or a finished one of an earlier run): arming starts from it.
HANDOFF_EDGES = {
    (None, ARMED),
    (ARMED, WAITING),  # the run's extraction is watched
    (WAITING, STOPPING),  # extraction verified complete
    (WAITING, CANCELLED),  # training was started by hand: auto-start stands down
    (STOPPING, GPU_WAIT),  # the server stopped
    (GPU_WAIT, LAUNCHING),  # the GPUs released
    (LAUNCHING, TRAINING),  # training launched, exactly once
    (TRAINING, TRAINING_DONE), (TRAINING, TRAINING_FAILED),
    (TRAINING, CANCELLED),  # training stopped on request
    *((s, CANCELLED) for s in CANCELLABLE),  # cancelled by an operator before training exists
    *((s, FAILED) for s in FOLLOWED),  # a step could not be taken (its reason says why)
}


@dataclass(frozen=True)
class HandoffState:
    """The auto-start handoff of one run, as the store keeps it (kv `handoff`, JSON): every field declared once.

    Written by pipeline/handoff/machine.py only (each step through its edge, `replace` for the rest); everyone
    else reads the attributes. `run` None: armed while no run was open, for the next run, which it joins."""

    step: HandoffStep | None = None  # None only inside `arm`'s transaction, before its first step
    run: str | None = None
    reason: str | None = None
    step_at: float | None = None  # when the step was entered
    armed_by: str | None = None
    armed_at: float | None = None
    for_next_run: bool = False
    train_floor: int | None = None  # the highest train process id before the launch: above it is this launch
    gpu_wait_since: float | None = None
    server_stopped_at: float | None = None
    train_proc_id: int | None = None  # the training the handoff follows to its end

    @classmethod
    def from_json(cls, data: dict | None) -> HandoffState | None:
        """The stored record (None: no handoff). A key this version does not know is left out, a missing one is
        its default: a store written by another version still reads."""
        if not data:
            return None
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("step") is not None:
            values["step"] = HandoffStep(values["step"])
        return cls(**values)

    def to_json(self) -> dict:
        out = asdict(self)
        out["step"] = None if self.step is None else str(self.step)
        return out

    def of_run(self, run: str | None) -> HandoffState | None:
        """This handoff as `run` sees it: None when it was made for another run (history once a newer run is
        open). With no run open, the last one still shows how it ended; one armed for the next run joins it."""
        return None if run is not None and self.run not in (None, run) else self

    @property
    def cancellable(self) -> bool:
        return self.step is not None and self.step.cancellable

    @property
    def followed(self) -> bool:
        return self.step is not None and self.step.followed

    @property
    def shown(self) -> str:
        """What status shows for auto-start: `off` once cancelled, else the step."""
        return "off" if self.step is None or self.step is HandoffStep.CANCELLED else str(self.step)


@dataclass(frozen=True)
class StateVersion:
    """What a button was drawn against: the open run and the handoff's step. Carried in the button's value as
    `run:step` (a stale button changes nothing); `step` None is auto-start off."""

    run: str | None
    step: HandoffStep | None

    def __str__(self) -> str:
        return f"{self.run}:{self.step or 'off'}"

    @classmethod
    def parse(cls, text: str | None) -> StateVersion | None:
        """A button's version, or None for one without (or with a value no version of eagle3 wrote)."""
        if not text or ":" not in text:
            return None
        run, step = text.rsplit(":", 1)
        try:
            return cls(run=None if run in ("None", "") else run, step=None if step == "off" else HandoffStep(step))
        except ValueError:
            return None

    @property
    def cancellable(self) -> bool:
        return self.step is not None and self.step.cancellable
