"""Stage supervision: start under a detached runner, verify, re-adopt, stop, record exits.

Identity is always (pid, create_time), never pid alone: after a restart of the
service a pid may belong to an unrelated process, and we never signal what we
cannot verify.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import overload

from pipeline.config import STAGE_NAMES, Workspace
from pipeline.errors import StageError
from pipeline.stages.host import SIGKILL, SIGTERM, RealHost, StopResult
from pipeline.stages.slurm import job_name
from pipeline.stages.slurm_executor import SlurmExecutor
from pipeline.states import (
    MAYBE_ALIVE_STATES,
    StageProc,
    StageState,
    close_run_after_training,
    transition,
)
from pipeline.store import Store

RUNNER_START_TIMEOUT_S = 10.0  # a row no live runner has started by then never will
RUNNER_AWAIT_MAX_S = 60.0  # how long `start` waits for a live runner's pid
KILL_WAIT_S = 5.0
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL after this long (the server has its own: [handoff] server_stop_grace_s)
RUNNER_EXIT_WAIT_S = 2.0
NO_RUNNER = "no runner took it up"  # a row whose service died before spawning its runner (not the command's fault)


class Supervisor:
    """Starts, verifies and stops the stages of one workspace."""

    def __init__(self, *, workspace: Workspace, store: Store, host=None) -> None:
        self.ws = workspace
        self.store = store
        self.host = host or RealHost()
        self.jobs = SlurmExecutor(workspace=workspace, store=store, host=self.host)  # stages run as Slurm jobs

    # --- verification -------------------------------------------------------
    def refresh(self) -> None:
        """Re-adopt running stages by (pid, create_time); mark unverifiable ones unknown."""
        for stage in STAGE_NAMES:
            proc = self.store.latest_proc(stage)
            if proc and proc.state in MAYBE_ALIVE_STATES:
                self._reconcile(proc)

    def _reconcile(self, proc: StageProc) -> None:
        if proc.is_job:
            self.jobs.reconcile(proc)
            return
        state = proc.state
        if proc.pid is None:
            self._close_if_never_started(proc)
            return
        seen = self.host.identity(proc.pid, proc.create_time)
        if seen == "alive":
            if state == StageState.UNKNOWN:
                transition(self.store, proc, StageState.RUNNING, reason="re-adopted: pid and create_time match")
        elif seen == "unverifiable":
            if state == StageState.RUNNING:
                transition(self.store, proc, StageState.UNKNOWN,
                           reason=f"pid {proc.pid} cannot be inspected (permission denied); not touching it")
        elif not self._runner_alive(proc):
            # Gone, and no runner left to record how it ended.
            target = StageState.STOPPED if proc.stop_requested else StageState.UNKNOWN
            if target != state:
                transition(self.store, proc, target, ended_at=self.host.clock(),
                           reason="the stage ended while no runner was watching; exit status unknown")

    def _runner_alive(self, proc: StageProc) -> bool:
        return self.host.identity(proc.runner_pid, proc.runner_create_time) == "alive"

    def _close_if_never_started(self, proc: StageProc) -> bool:
        """A row with no pid whose runner is gone, or that no runner took up, for
        RUNNER_START_TIMEOUT_S never started its stage: close it (exited, no exit code) so that
        a start or the handoff may launch the stage again. A runner takes its row up in the
        same kind of transaction (`claim_row`), so a late one finds it closed and starts nothing."""
        with self.store.atomic():
            row = self.store.row(proc.id)
            if (row.pid is not None or row.state not in MAYBE_ALIVE_STATES
                    or self._runner_alive(row)
                    or self.host.clock() - (row.started_at or 0) < RUNNER_START_TIMEOUT_S):
                return False
            why = (f"its runner (pid {row.runner_pid}) died before starting it" if row.runner_pid
                   else f"{NO_RUNNER} within {RUNNER_START_TIMEOUT_S:.0f} s (the service that started it "
                        "may have died)")
            transition(self.store, row, StageState.EXITED, ended_at=self.host.clock(), reason=f"never started: {why}")
        proc.update(**row.to_dict())
        return True

    def is_running(self, stage: str) -> bool:
        """True when the stage's latest process is verified alive."""
        proc = self.store.latest_proc(stage)
        return proc is not None and proc.state == StageState.RUNNING

    # --- start ----------------------------------------------------------------
    @overload
    def start(self, stage: str, *, only_if: None = None, restart_count: int = 0) -> StageProc: ...

    @overload
    def start(self, stage: str, *, only_if: Callable[[], bool], restart_count: int = 0) -> StageProc | None: ...

    def start(self, stage: str, *, only_if: Callable[[], bool] | None = None,
              restart_count: int = 0) -> StageProc | None:
        """Start `stage` under a detached runner (or submit it as a Slurm job); returns its process row
        once it has a pid (or a job id). `restart_count`: the restarts before it (the restart policy's; a
        start by hand is 0). With `only_if`, a check made in the same transaction as the row's insert: when it fails nothing is
        started and None is returned (the handoff's launch against a cancel that lands meanwhile)."""
        self.ws.require_filled(stage)
        self.refresh()
        proc = self.store.latest_proc(stage)
        if proc and proc.state in MAYBE_ALIVE_STATES:
            held = proc.who if proc.launched else "its process is being started"
            raise StageError(f"{stage} is already {proc.state} ({held}); see `eagle3 status`, "
                             f"or stop it first with `eagle3 stop {stage}`")
        run_id = self.store.open_run()
        cfg = self.ws.for_run(run_id).stage(stage)  # `{run}` in its argv: this run's own place
        argv, on_slurm = cfg.argv, cfg.on_slurm
        with self.store.atomic():
            if only_if is not None and not only_if():
                return None
            proc_id = self.store.insert_proc({
                "run_id": run_id, "stage": stage, "state": str(StageState.QUEUED if on_slurm else StageState.RUNNING),
                "argv": json.dumps(argv), "log": str(self.ws.for_run(run_id).log_path(stage)), "started_at": self.host.clock(),
                "stop_requested": 0, "executor": cfg.executor.kind, "restart_count": restart_count,
            })
            if on_slurm:  # the submission is recorded (by the job's name) before sbatch is run
                self.store.update_proc(proc_id, job_name=job_name(run_id, stage, proc_id))
            self.store.add_event(kind="stage-start-requested", run_id=run_id, stage=stage, data={"argv": argv})
        if on_slurm:
            return self.jobs.submit(stage, proc_id)
        runner_argv = [sys.executable, "-m", "pipeline.stages.runner", "--config", str(self.ws.path),
                       "--stage", stage, "--proc-id", str(proc_id)]
        runner_pid = self.host.spawn_detached(runner_argv, cwd=str(self.ws.root))
        self.store.update_proc(proc_id, runner_pid=runner_pid, runner_create_time=self.host.create_time(runner_pid))
        return self._await_pid(proc_id)

    def _await_pid(self, proc_id: int) -> StageProc:
        """Wait for the runner to report the stage's pid; a runner that dies first (or a slow one
        past RUNNER_AWAIT_MAX_S) leaves the row closed as never started (or still starting)."""
        deadline = self.host.clock() + RUNNER_AWAIT_MAX_S
        while True:
            proc = self.store.row(proc_id)
            if proc.pid is not None or proc.state != StageState.RUNNING:
                return proc
            if self._close_if_never_started(proc) or self.host.clock() > deadline:
                return proc
            self.host.sleep(0.05)

    # --- stop -----------------------------------------------------------------
    def stop(self, stage: str, *, grace_s: float) -> StopResult:
        """Request a stop: SIGTERM to the group, wait `grace_s`, SIGKILL, report survivors."""
        self.refresh()
        proc = self.store.latest_proc(stage)
        if not proc or proc.state not in MAYBE_ALIVE_STATES:
            return StopResult(stage=stage, was_running=False, note="not running")
        if proc.is_job:
            return self.jobs.stop(proc, grace_s=grace_s)
        if proc.pid is not None and self.host.identity(proc.pid, proc.create_time) == "unverifiable":
            raise StageError(f"{stage}: pid {proc.pid} cannot be verified as the stage (permission denied); "
                             "not signalling it — stop it by hand")
        self.store.update_proc(proc.id, stop_requested=1)
        self.store.add_event(kind="stop-requested", run_id=proc.run_id, stage=stage, data={"grace_s": grace_s})
        result = StopResult(stage=stage, was_running=True)
        # Linux never hands out a pid still used as a process-group id, so when the
        # leader's pid is held by another process our group is gone: signal nothing.
        if self.host.identity(proc.pid, proc.create_time) == "reused":
            result.note = f"pid {proc.pid} now belongs to another process; nothing was signalled"
        elif proc.pid is not None:
            pgid, since = proc.pgid or proc.pid, proc.create_time or 0.0
            # who is the stage as the stop begins: a worker in a session of its own (torchrun's ranks) is the stage's
            # only through its launcher, and stays to be waited for and killed once that launcher is gone
            known = self.host.members(pgid, since)
            self._signal_all(pgid, since, SIGTERM, known)
            if not self._wait_empty(pgid, since, grace_s, known):
                result.escalated = True
                self._signal_all(pgid, since, SIGKILL, known)
                self._wait_empty(pgid, since, KILL_WAIT_S, known)
            result.survivors = self._left(pgid, since, known)
        self._await_exit_record(proc)
        return result

    def _left(self, pgid: int, since: float, known: Sequence) -> list:
        """The stage's processes now, with those `known` at the stop's start that still live (an orphaned worker
        leaves the group and session with its launcher's death)."""
        now = {m.pid: m for m in self.host.members(pgid, since)}
        for m in known:
            if m.pid not in now and self.host.identity(m.pid, m.create_time) == "alive":
                now[m.pid] = m
        return list(now.values())

    def _signal_all(self, pgid: int, since: float, sig: int, known: Sequence = ()) -> None:
        self.host.kill(pgid, sig, group=True)
        for member in self._left(pgid, since, list(known)):  # session members, descendants outside the group
            self.host.kill(member.pid, sig, group=False)

    def _wait_empty(self, pgid: int, since: float, timeout_s: float, known: Sequence = ()) -> bool:
        deadline = self.host.clock() + timeout_s
        while self._left(pgid, since, list(known)):
            if self.host.clock() >= deadline:
                return False
            self.host.sleep(0.1)
        return True

    def _await_exit_record(self, proc: StageProc) -> None:
        """Give the runner a moment to record the exit status; record it ourselves if it cannot."""
        deadline = self.host.clock() + 3.0
        while self.host.clock() < deadline:
            row = self.store.row(proc.id)
            if row.state not in MAYBE_ALIVE_STATES or not self._runner_alive(row):
                break
            self.host.sleep(0.05)
        row = self.store.row(proc.id)
        if row.state in MAYBE_ALIVE_STATES:
            transition(self.store, row, StageState.STOPPED, ended_at=self.host.clock(),
                       reason="stopped; exit status not recorded (no runner)")
        # The runner exits just after recording: a stop returns once it is gone, so that
        # "stopped" means nothing of the stage is left (a few ms; bounded in case it hangs).
        deadline = self.host.clock() + RUNNER_EXIT_WAIT_S
        while self._runner_alive(row) and self.host.clock() < deadline:
            self.host.sleep(0.02)

    def stop_all(self, *, grace_s: float) -> list[StopResult]:
        """Stop every stage (training first, the server last) and close the run."""
        shown = [s for s in reversed(STAGE_NAMES)  # an optional stage never configured nor run is not listed
                 if s != "regenerate" or self.ws.stage(s).argv or self.store.latest_proc(s) is not None]
        results = [self.stop(stage, grace_s=grace_s) for stage in shown]
        run_id = self.store.current_run()
        if run_id:
            self.store.close_run(run_id, reason="all stages stopped")
        return results


def claim_row(store: Store, proc_id: int, *, runner_pid: int, runner_create_time: float | None) -> StageProc | None:
    """The runner takes up its row before starting anything: returns the row, or None when the
    row was closed meanwhile (the supervisor concluded it never started) or already has a stage."""
    with store.atomic():
        row = store.proc(proc_id)
        if not row or row.state != StageState.RUNNING or row.pid is not None:
            return None
        store.update_proc(proc_id, runner_pid=runner_pid, runner_create_time=runner_create_time)
    return store.row(proc_id)


def record_exit(store: Store, proc_id: int, *, returncode: int, now: float, reason: str = "") -> StageProc:
    """Record how a stage's process ended (called by its runner); close the run after training."""
    proc = store.row(proc_id)
    fields = {"ended_at": now, "exit_code": returncode if returncode >= 0 else None,
              "signal": -returncode if returncode < 0 else None}
    target = StageState.STOPPED if proc.stop_requested else StageState.EXITED
    transition(store, proc, target, reason=reason or _describe(returncode), **fields)
    close_run_after_training(store, proc, target)
    return proc


def _describe(returncode: int) -> str:
    return f"exit code {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"
