"""Stage process states and the one transition function (stdlib only)."""

from __future__ import annotations

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



def has_ended(row: dict) -> bool:
    """The row's process has ended: exited, stopped, or unknown with its end recorded (it vanished)."""
    return row["state"] in ENDED_STATES or (row["state"] == StageState.UNKNOWN and bool(row.get("ended_at")))


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


def transition(store, proc: dict, to: StageState, *, reason: str = "", **fields) -> None:
    """Move a stage-process row to `to`, asserting the edge and recording an event."""
    frm = StageState(proc["state"])
    if frm == to and not fields and (not reason or reason == proc.get("reason")):
        return  # nothing changes (the same state with a new reason updates the reason, without an event)
    if frm != to and (frm, to) not in _EDGES:
        raise AssertionError(f"illegal stage transition {frm} -> {to}")
    with store.atomic():
        store.update_proc(proc["id"], state=str(to), reason=reason or proc.get("reason"), **fields)
        if frm != to:
            store.add_event(
                kind=f"stage-{to}", run_id=proc["run_id"], stage=proc["stage"],
                data={"from": str(frm), "reason": reason, **fields},
            )
    proc.update(state=str(to), reason=reason or proc.get("reason"), **fields)


def close_run_after_training(store, proc: dict, target: StageState) -> None:
    """Training that finished (exit 0, not stopped) ends its run, when that run is still the current
    one. A training stopped on request or failed leaves the run open: `eagle3 start train`, the
    restart policy and the handoff's relaunch resume it within the same run, whose extraction is
    the one training reads (`stop --all` closes a run for good)."""
    if (proc["stage"] == "train" and target == StageState.EXITED and proc.get("exit_code") == 0
            and proc["run_id"] == store.current_run()):
        store.close_run(proc["run_id"], reason="training finished (exit 0)")
