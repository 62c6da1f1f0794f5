"""Stage supervision: start under a detached runner, verify, re-adopt, stop, record exits.

Identity is always (pid, create_time), never pid alone: after a restart of the
service a pid may belong to an unrelated process, and we never signal what we
cannot verify.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from pipeline.config import STAGE_NAMES, Workspace
from pipeline.errors import StageError
from pipeline.stages import slurm
from pipeline.stages.host import SIGKILL, SIGTERM, Member, RealHost, stage_env
from pipeline.stages.states import MAYBE_ALIVE_STATES, StageState, transition
from pipeline.store import Store

RUNNER_START_TIMEOUT_S = 10.0  # a row no live runner has started by then never will
RUNNER_AWAIT_MAX_S = 60.0  # how long `start` waits for a live runner's pid
KILL_WAIT_S = 5.0
RUNNER_EXIT_WAIT_S = 2.0
SUBMIT_WINDOW_S = 60.0  # a job row with no id and no job of its name after this was never submitted
JOB_POLL_S = 0.5
NO_RUNNER = "no runner took it up"  # a row whose service died before spawning its runner (not the command's fault)


@dataclass
class StopResult:
    """What `stop` did to one stage."""

    stage: str
    was_running: bool
    escalated: bool = False  # SIGKILL was needed
    survivors: list[Member] = field(default_factory=list)
    note: str = ""


class Supervisor:
    """Starts, verifies and stops the stages of one workspace."""

    def __init__(self, *, workspace: Workspace, store: Store, host=None) -> None:
        self.ws = workspace
        self.store = store
        self.host = host or RealHost()

    # --- verification -------------------------------------------------------
    def refresh(self) -> None:
        """Re-adopt running stages by (pid, create_time); mark unverifiable ones unknown."""
        for stage in STAGE_NAMES:
            proc = self.store.latest_proc(stage)
            if proc and StageState(proc["state"]) in MAYBE_ALIVE_STATES:
                self._reconcile(proc)

    def _reconcile(self, proc: dict) -> None:
        if is_job(proc):
            self._reconcile_job(proc)
            return
        state = StageState(proc["state"])
        if proc["pid"] is None:
            self._close_if_never_started(proc)
            return
        seen = self.host.identity(proc["pid"], proc["create_time"])
        if seen == "alive":
            if state == StageState.UNKNOWN:
                transition(self.store, proc, StageState.RUNNING, reason="re-adopted: pid and create_time match")
        elif seen == "unverifiable":
            if state == StageState.RUNNING:
                transition(self.store, proc, StageState.UNKNOWN,
                           reason=f"pid {proc['pid']} cannot be inspected (permission denied); not touching it")
        elif not self._runner_alive(proc):
            # Gone, and no runner left to record how it ended.
            target = StageState.STOPPED if proc["stop_requested"] else StageState.UNKNOWN
            if target != state:
                transition(self.store, proc, target, ended_at=self.host.clock(),
                           reason="the stage ended while no runner was watching; exit status unknown")

    def _reconcile_job(self, proc: dict) -> None:
        """A Slurm job's row from what the cluster says: queued (with Slurm's reason), running, or ended
        with its exit code and Slurm's reason. A job the cluster no longer knows is unknown, never running."""
        if not proc["job_id"]:
            try:  # submitted, but the service died before recording the id: find it by its name
                found = slurm.find(proc["job_name"])
            except slurm.SlurmError as exc:
                self._job_unknown(proc, f"cannot ask Slurm about job {proc['job_name']}: {exc}")
                return
            if found:
                self.store.update_proc(proc["id"], job_id=found[0])
                proc["job_id"] = found[0]
            else:
                if self.host.clock() - (proc["started_at"] or 0) >= SUBMIT_WINDOW_S:
                    transition(self.store, proc, StageState.EXITED, ended_at=self.host.clock(),
                               reason=f"never started: no Slurm job named {proc['job_name']} (the submission "
                                      "did not reach the cluster)")
                return
        info = slurm.query(proc["job_id"])
        if not info.known:
            self._job_unknown(proc, info.reason or "the cluster does not answer")
        elif info.pending:
            why = f"queued: Slurm job {proc['job_id']} is {info.state} ({info.reason or 'no reason given'})"
            if proc["state"] != StageState.QUEUED:
                transition(self.store, proc, StageState.QUEUED, reason=why)
            elif proc["reason"] != why:  # Slurm's reason changes while it waits (None → Priority → Resources)
                self.store.update_proc(proc["id"], reason=why)
                proc["reason"] = why
        elif info.active:
            if info.host and proc.get("job_host") != info.host:
                self.store.update_proc(proc["id"], job_host=info.host)
                proc["job_host"] = info.host
            if proc["state"] != StageState.RUNNING:
                transition(self.store, proc, StageState.RUNNING, reason=f"Slurm job {proc['job_id']} is {info.state}")
        elif info.ended:
            target = StageState.STOPPED if proc["stop_requested"] else StageState.EXITED
            transition(self.store, proc, target, ended_at=self.host.clock(), exit_code=info.exit_code,
                       signal=info.signal, reason=info.describe())
            if proc["stage"] == "train" and proc["run_id"] == self.store.current_run():
                self.store.close_run(proc["run_id"], reason=f"training {target}")
        else:
            self._job_unknown(proc, f"Slurm job {proc['job_id']} is in state {info.state or '?'}")

    def _job_unknown(self, proc: dict, why: str) -> None:
        if proc["state"] != StageState.UNKNOWN:
            transition(self.store, proc, StageState.UNKNOWN, reason=why)
        elif proc["reason"] != why:
            self.store.update_proc(proc["id"], reason=why)
            proc["reason"] = why

    def _runner_alive(self, proc: dict) -> bool:
        return self.host.identity(proc["runner_pid"], proc["runner_create_time"]) == "alive"

    def _close_if_never_started(self, proc: dict) -> bool:
        """A row with no pid whose runner is gone, or that no runner took up, for
        RUNNER_START_TIMEOUT_S never started its stage: close it (exited, no exit code) so that
        a start or the handoff may launch the stage again. A runner takes its row up in the
        same kind of transaction (`claim_row`), so a late one finds it closed and starts nothing."""
        with self.store.atomic():
            row = self.store.proc(proc["id"])
            if (row["pid"] is not None or StageState(row["state"]) not in MAYBE_ALIVE_STATES
                    or self._runner_alive(row)
                    or self.host.clock() - (row["started_at"] or 0) < RUNNER_START_TIMEOUT_S):
                return False
            why = (f"its runner (pid {row['runner_pid']}) died before starting it" if row["runner_pid"]
                   else f"{NO_RUNNER} within {RUNNER_START_TIMEOUT_S:.0f} s (the service that started it "
                        "may have died)")
            transition(self.store, row, StageState.EXITED, ended_at=self.host.clock(), reason=f"never started: {why}")
        proc.update(row)
        return True

    def is_running(self, stage: str) -> bool:
        """True when the stage's latest process is verified alive."""
        proc = self.store.latest_proc(stage)
        return bool(proc) and proc["state"] == StageState.RUNNING

    # --- start ----------------------------------------------------------------
    def start(self, stage: str, *, only_if=None) -> dict | None:
        """Start `stage` under a detached runner; returns its process row once it has a pid. With
        `only_if`, a check made in the same transaction as the row's insert: when it fails nothing is
        started and None is returned (the handoff's launch against a cancel that lands meanwhile)."""
        self.ws.require_filled(stage)
        self.refresh()
        proc = self.store.latest_proc(stage)
        if proc and StageState(proc["state"]) in MAYBE_ALIVE_STATES:
            who = f"pid {proc['pid']}" if proc["pid"] is not None else "its process is being started"
            raise StageError(f"{stage} is already {proc['state']} ({who}); see `eagle3 status`, "
                             f"or stop it first with `eagle3 stop {stage}`")
        run_id = self.store.open_run()
        cfg = self.ws.stage(stage)
        argv, on_slurm = cfg.argv, cfg.executor == "slurm"
        with self.store.atomic():
            if only_if is not None and not only_if():
                return None
            proc_id = self.store.insert_proc({
                "run_id": run_id, "stage": stage, "state": str(StageState.QUEUED if on_slurm else StageState.RUNNING),
                "argv": json.dumps(argv), "log": str(self.ws.log_path(stage)), "started_at": self.host.clock(),
                "stop_requested": 0, "executor": cfg.executor,
            })
            if on_slurm:  # the submission is recorded (by the job's name) before sbatch is run
                self.store.update_proc(proc_id, job_name=slurm.job_name(run_id, stage, proc_id))
            self.store.add_event(kind="stage-start-requested", run_id=run_id, stage=stage, data={"argv": argv})
        if on_slurm:
            return self._submit(stage, proc_id)
        runner_argv = [sys.executable, "-m", "pipeline.stages.runner", "--config", str(self.ws.path),
                       "--stage", stage, "--proc-id", str(proc_id)]
        runner_pid = self.host.spawn_detached(runner_argv, cwd=str(self.ws.root))
        self.store.update_proc(proc_id, runner_pid=runner_pid, runner_create_time=self.host.create_time(runner_pid))
        return self._await_pid(proc_id)

    def _submit(self, stage: str, proc_id: int) -> dict:
        """sbatch the stage's generated script; the row gets the job id, then the job's state."""
        proc = self.store.proc(proc_id)
        cfg = self.ws.stage(stage)
        log = self.ws.log_path(stage)
        log.parent.mkdir(parents=True, exist_ok=True)
        text = slurm.batch_script(name=proc["job_name"], argv=cfg.argv, cfg=cfg, slurm=self.ws.config.slurm, log=log,
                                  cwd=self.ws.resolve(cfg.cwd) or self.ws.root)
        script = slurm.write_script(self.ws.state_dir / "slurm", proc["job_name"], text)
        env = stage_env(self.ws, stage)  # sbatch exports it to the job: ours without the Slack secrets
        try:
            job = slurm.submit(script, env=env)
        except slurm.SlurmError as exc:
            transition(self.store, proc, StageState.EXITED, ended_at=self.host.clock(), reason=f"never started: {exc}")
            raise StageError(f"{stage}: {exc}") from None
        self.store.update_proc(proc_id, job_id=job)
        self.store.add_event(kind="slurm-submitted", run_id=proc["run_id"], stage=stage,
                             data={"job_id": job, "job_name": proc["job_name"], "script": str(script)})
        proc = self.store.proc(proc_id)
        self._reconcile_job(proc)
        return self.store.proc(proc_id)

    def _await_pid(self, proc_id: int) -> dict:
        """Wait for the runner to report the stage's pid; a runner that dies first (or a slow one
        past RUNNER_AWAIT_MAX_S) leaves the row closed as never started (or still starting)."""
        deadline = self.host.clock() + RUNNER_AWAIT_MAX_S
        while True:
            proc = self.store.proc(proc_id)
            if proc["pid"] is not None or proc["state"] != StageState.RUNNING:
                return proc
            if self._close_if_never_started(proc) or self.host.clock() > deadline:
                return proc
            self.host.sleep(0.05)

    # --- stop -----------------------------------------------------------------
    def stop(self, stage: str, *, grace_s: float) -> StopResult:
        """Request a stop: SIGTERM to the group, wait `grace_s`, SIGKILL, report survivors."""
        self.refresh()
        proc = self.store.latest_proc(stage)
        if not proc or StageState(proc["state"]) not in MAYBE_ALIVE_STATES:
            return StopResult(stage=stage, was_running=False, note="not running")
        if is_job(proc):
            return self._stop_job(proc, grace_s=grace_s)
        if proc["pid"] is not None and self.host.identity(proc["pid"], proc["create_time"]) == "unverifiable":
            raise StageError(f"{stage}: pid {proc['pid']} cannot be verified as the stage (permission denied); "
                             "not signalling it — stop it by hand")
        self.store.update_proc(proc["id"], stop_requested=1)
        self.store.add_event(kind="stop-requested", run_id=proc["run_id"], stage=stage, data={"grace_s": grace_s})
        result = StopResult(stage=stage, was_running=True)
        # Linux never hands out a pid still used as a process-group id, so when the
        # leader's pid is held by another process our group is gone: signal nothing.
        if self.host.identity(proc["pid"], proc["create_time"]) == "reused":
            result.note = f"pid {proc['pid']} now belongs to another process; nothing was signalled"
        elif proc["pid"] is not None:
            pgid = proc["pgid"]
            self._signal_all(pgid, proc["create_time"], SIGTERM)
            if not self._wait_empty(pgid, proc["create_time"], grace_s):
                result.escalated = True
                self._signal_all(pgid, proc["create_time"], SIGKILL)
                self._wait_empty(pgid, proc["create_time"], KILL_WAIT_S)
            result.survivors = self.host.members(pgid, proc["create_time"])
        self._await_exit_record(proc)
        return result

    def _stop_job(self, proc: dict, *, grace_s: float) -> StopResult:
        """scancel --signal=TERM --full (the batch script and its steps), the grace, then scancel; a
        pending job is cancelled at once. Stopped once Slurm reports the job ended."""
        self.store.update_proc(proc["id"], stop_requested=1)
        proc["stop_requested"] = 1
        self.store.add_event(kind="stop-requested", run_id=proc["run_id"], stage=proc["stage"],
                             data={"grace_s": grace_s, "job_id": proc["job_id"]})
        result = StopResult(stage=proc["stage"], was_running=True)
        if not proc["job_id"]:
            self._reconcile_job(proc)  # found by its name, or closed as never submitted
        if proc["job_id"]:
            if proc["state"] == StageState.QUEUED:
                slurm.cancel(proc["job_id"])
            else:
                slurm.cancel(proc["job_id"], signal="TERM")
                if not self._wait_job(proc, grace_s):
                    result.escalated = True
                    slurm.cancel(proc["job_id"])
            if not self._wait_job(proc, KILL_WAIT_S + 30.0):
                result.note = f"Slurm job {proc['job_id']} has not ended yet; scancel was sent"
        self._reconcile_job(proc)
        return result

    def _wait_job(self, proc: dict, timeout_s: float) -> bool:
        deadline = self.host.clock() + timeout_s
        while True:
            info = slurm.query(proc["job_id"])
            if info.ended or not info.known:
                return True
            if self.host.clock() >= deadline:
                return False
            self.host.sleep(JOB_POLL_S)

    def _signal_all(self, pgid: int, since: float, sig: int) -> None:
        self.host.kill(pgid, sig, group=True)
        for member in self.host.members(pgid, since):  # session members outside the group
            self.host.kill(member.pid, sig, group=False)

    def _wait_empty(self, pgid: int, since: float, timeout_s: float) -> bool:
        deadline = self.host.clock() + timeout_s
        while self.host.members(pgid, since):
            if self.host.clock() >= deadline:
                return False
            self.host.sleep(0.1)
        return True

    def _await_exit_record(self, proc: dict) -> None:
        """Give the runner a moment to record the exit status; record it ourselves if it cannot."""
        deadline = self.host.clock() + 3.0
        while self.host.clock() < deadline:
            row = self.store.proc(proc["id"])
            if StageState(row["state"]) not in MAYBE_ALIVE_STATES or not self._runner_alive(row):
                break
            self.host.sleep(0.05)
        row = self.store.proc(proc["id"])
        if StageState(row["state"]) in MAYBE_ALIVE_STATES:
            transition(self.store, row, StageState.STOPPED, ended_at=self.host.clock(),
                       reason="stopped; exit status not recorded (no runner)")
        # The runner exits just after recording: a stop returns once it is gone, so that
        # "stopped" means nothing of the stage is left (a few ms; bounded in case it hangs).
        deadline = self.host.clock() + RUNNER_EXIT_WAIT_S
        while self._runner_alive(row) and self.host.clock() < deadline:
            self.host.sleep(0.02)

    def stop_all(self, *, grace_s: float) -> list[StopResult]:
        """Stop every stage (training first, the server last) and close the run."""
        results = [self.stop(stage, grace_s=grace_s) for stage in reversed(STAGE_NAMES)]
        run_id = self.store.current_run()
        if run_id:
            self.store.close_run(run_id, reason="all stages stopped")
        return results


def claim_row(store: Store, proc_id: int, *, runner_pid: int, runner_create_time: float | None) -> dict | None:
    """The runner takes up its row before starting anything: returns the row, or None when the
    row was closed meanwhile (the supervisor concluded it never started) or already has a stage."""
    with store.atomic():
        row = store.proc(proc_id)
        if not row or row["state"] != StageState.RUNNING or row["pid"] is not None:
            return None
        store.update_proc(proc_id, runner_pid=runner_pid, runner_create_time=runner_create_time)
    return store.proc(proc_id)


def record_exit(store: Store, proc_id: int, *, returncode: int, now: float, reason: str = "") -> dict:
    """Record how a stage's process ended (called by its runner); close the run after training."""
    proc = store.proc(proc_id)
    fields = {"ended_at": now, "exit_code": returncode if returncode >= 0 else None,
              "signal": -returncode if returncode < 0 else None}
    target = StageState.STOPPED if proc["stop_requested"] else StageState.EXITED
    transition(store, proc, target, reason=reason or _describe(returncode), **fields)
    if proc["stage"] == "train" and proc["run_id"] == store.current_run():
        store.close_run(proc["run_id"], reason=f"training {target}")
    return proc


def _describe(returncode: int) -> str:
    return f"exit code {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"


def is_job(row: dict) -> bool:
    """The row is a stage run by Slurm (not the local runner)."""
    return row.get("executor") == "slurm"


def launched(row: dict) -> bool:
    """The row's stage was handed to something that runs it: a pid, or a Slurm job id."""
    return row["pid"] is not None or bool(row.get("job_id"))


def who(row: dict) -> str:
    """`pid 123` or `Slurm job 45`."""
    return f"Slurm job {row['job_id']}" if is_job(row) else f"pid {row['pid']}"
