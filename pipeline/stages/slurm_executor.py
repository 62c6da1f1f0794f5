"""The Slurm executor: a stage as a Slurm job, behind the supervisor's verbs (start, refresh, stop).

The supervisor keeps one row per start in the store whichever executor runs it; for a job the
row's identity is the job's id (and, before sbatch answers, its name), as (pid, create_time) is a
local process's. Supervision, verdicts, the handoff, Slack and `status --json` read the row.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import SlurmSettings, Workspace
from pipeline.errors import StageError
from pipeline.stages import slurm
from pipeline.stages.host import StopResult, stage_env
from pipeline.stages.logfile import rotate_in_place, tail_lines
from pipeline.states import StageProc, StageState, close_run_after_training, record, transition
from pipeline.store import Store
from pipeline.train.outdir import named_latest
from pipeline.verdict import fmt_s

SUBMIT_WINDOW_S = 60.0  # a job row with no id and no job of its name after this was never submitted
JOB_POLL_S = 0.5
JOB_END_WAIT_S = 35.0  # after scancel: Slurm's KillWait (30 s by default) and the epilog


class SlurmExecutor:
    """Submits, follows and cancels the jobs of one workspace's Slurm stages."""

    def __init__(self, *, workspace: Workspace, store: Store, host) -> None:
        self.ws, self.store, self.host = workspace, store, host

    def reconcile(self, proc: StageProc) -> None:
        """A Slurm job's row from what the cluster says: queued (with Slurm's reason), running, or ended
        with its exit code and Slurm's reason. A job the cluster no longer knows is unknown, never running."""
        if not proc.job_id:
            try:  # submitted, but the service died before recording the id: find it by its name
                found = slurm.find(_name(proc))
            except slurm.SlurmError as exc:
                transition(self.store, proc, StageState.UNKNOWN,
                           reason=f"cannot ask Slurm about job {proc.job_name}: {exc}")
                return
            if found:
                record(self.store, proc, job_id=found[0])
                if proc.stop_requested:  # stopped while its id was unknown: the stop applies to it now
                    slurm.cancel(found[0])
            else:
                if self.host.clock() - (proc.started_at or 0) >= SUBMIT_WINDOW_S:
                    transition(self.store, proc, StageState.EXITED, ended_at=self.host.clock(),
                               reason=f"never started: no Slurm job named {proc.job_name} (the submission "
                                      "did not reach the cluster)")
                return
        info = slurm.query(proc.job_id or "")
        if info.known and info.restarts > (proc.job_restarts or 0) and not self._requeued(proc, info):
            return  # past its restart limit: cancelled, and closed once Slurm reports it ended
        if not info.known:
            transition(self.store, proc, StageState.UNKNOWN, reason=info.reason or "the cluster does not answer")
        elif info.pending:
            # Slurm's reason changes while the job waits (None → Priority → Resources → BeginTime after a requeue)
            again = f", requeued {info.restarts}×" if info.restarts else ""
            transition(self.store, proc, StageState.QUEUED, reason=f"queued: Slurm job {proc.job_id} is {info.state} "
                                                                   f"({info.reason or 'waiting to be scheduled'}{again})")
        elif info.active:
            self._seen(proc, info)
            transition(self.store, proc, StageState.RUNNING, reason=f"Slurm job {proc.job_id} is {info.state}")
            state = self.ws.config.state  # the job appends to the stage's log; it is rotated here, as the runner does
            rotate_in_place(Path(proc.log or self.ws.log_path(proc.stage)), max_bytes=state.log_max_bytes,
                            keep=state.log_keep)
        elif info.ended:
            self._seen(proc, info)  # a job that ran and ended between two looks: where it ran, all the same
            target = StageState.STOPPED if proc.stop_requested else StageState.EXITED
            transition(self.store, proc, target, ended_at=self.host.clock(), exit_code=info.exit_code, job_state=info.state,
                       signal=info.signal, reason=info.describe_stop() if proc.stop_requested else info.describe())
            close_run_after_training(self.store, proc, target)
        else:
            transition(self.store, proc, StageState.UNKNOWN, reason=f"Slurm job {proc.job_id} is in state "
                                                                    f"{info.state or '?'}")

    def _seen(self, proc: StageProc, info: slurm.JobInfo) -> None:
        """Where the job runs (or ran), its time limit and when that limit ends it, as the cluster says now."""
        seen = {"job_host": info.host, "job_nodes": info.nodes, "job_limit_s": info.limit_s, "job_end_at": info.end_at}
        changed = {k: v for k, v in seen.items() if v is not None and getattr(proc, k) != v}
        if changed:
            record(self.store, proc, **changed)

    def _requeued(self, proc: StageProc, info: slurm.JobInfo) -> bool:
        """Slurm requeued the job (its restarts went up): after the stage stopped at the time-limit warning (the
        batch script requeues itself), a node failure or a preemption. Said once per requeue; past the stage's
        max_restarts the job is cancelled instead (False)."""
        cfg = self.ws.stage(proc.stage)
        limit = cfg.max_restarts
        if info.restarts > limit:
            slurm.cancel(proc.job_id or "")
            record(self.store, proc, job_restarts=info.restarts, restart_given_up=1)
            self.store.add_event(kind="restart-limit", run_id=proc.run_id, stage=proc.stage, data={
                "reason": f"{proc.stage}: Slurm requeued job {proc.job_id} {info.restarts} times, past max_restarts "
                          f"= {limit} ({self._why(proc, info.restarts)}): cancelled"})
            return False
        data = interruption(self.ws, self.store, proc, why=self._why(proc, info.restarts), attempt=info.restarts,
                            limit=limit, job=proc.job_id, how="requeued")
        with self.store.atomic():
            record(self.store, proc, job_restarts=info.restarts)
            self.store.add_event(kind="stage-requeued", run_id=proc.run_id, stage=proc.stage, data=data)
        return True

    def _why(self, proc: StageProc, restart: int) -> str:
        """What ended the job's last allocation: its time limit (the batch script said it requeued itself), a node
        Slurm now reports down, or neither (a preemption, `scontrol requeue`)."""
        try:
            said = any(slurm.REQUEUE_LINE.format(job=proc.job_id, restart=restart) in line
                       for line in tail_lines(Path(proc.log or self.ws.log_path(proc.stage)), 200))
        except OSError:
            said = False
        if said:
            return f"reached {limit_text(proc.job_limit_s)}"
        for node in slurm.hostnames(proc.job_nodes or proc.job_host or "") if (proc.job_nodes or proc.job_host) else []:
            state = slurm.node_state(node)
            if state and any(w in state for w in ("DOWN", "FAIL", "NOT_RESPONDING")):
                return f"lost node {node} ({state})"
        return "was requeued by Slurm (a preemption, or `scontrol requeue`)"

    def submit(self, stage: str, proc_id: int) -> StageProc:
        """sbatch the stage's generated script; the row gets the job id, then the job's state."""
        proc = self.store.row(proc_id)
        ws = self.ws.for_run(proc.run_id)
        cfg = ws.stage(stage)
        log = ws.log_path(stage)
        log.parent.mkdir(parents=True, exist_ok=True)
        text = slurm.batch_script(name=_name(proc), argv=cfg.argv, stage=cfg, slurm=ws.config.slurm, log=log,
                                  cwd=ws.resolve(cfg.cwd) or ws.root)
        script = slurm.write_script(ws.state_dir / "slurm", _name(proc), text)
        env = stage_env(ws, stage, run=proc.run_id)  # sbatch exports it to the job: ours without the Slack secrets
        try:
            job = slurm.submit(script, env=env)
        except slurm.SlurmError as exc:
            transition(self.store, proc, StageState.EXITED, ended_at=self.host.clock(), reason=f"never started: {exc}")
            raise StageError(f"{stage}: {exc}") from None
        self.store.update_proc(proc_id, job_id=job)
        self.store.add_event(kind="slurm-submitted", run_id=proc.run_id, stage=stage,
                             data={"job_id": job, "job_name": proc.job_name, "script": str(script)})
        proc = self.store.row(proc_id)
        self.reconcile(proc)
        return self.store.row(proc_id)

    def stop(self, proc: StageProc, *, grace_s: float) -> StopResult:
        """scancel --signal=TERM --full (the batch script and its steps), the grace, then scancel; a
        pending job is cancelled at once. Stopped once Slurm reports the job ended."""
        record(self.store, proc, stop_requested=1)
        self.store.add_event(kind="stop-requested", run_id=proc.run_id, stage=proc.stage,
                             data={"grace_s": grace_s, "job_id": proc.job_id})
        result = StopResult(stage=proc.stage, was_running=True)
        if not proc.job_id:
            self.reconcile(proc)  # found by its name, or closed as never submitted
        if proc.job_id:
            if proc.state == StageState.QUEUED:
                slurm.cancel(proc.job_id)
            else:
                slurm.cancel(proc.job_id, signal="TERM")
                if not self._wait_job(proc, grace_s):
                    result.escalated = True
                    slurm.cancel(proc.job_id)
            if not self._wait_job(proc, JOB_END_WAIT_S):
                result.note = f"Slurm job {proc.job_id} has not ended yet; scancel was sent"
        self.reconcile(proc)
        return result

    def _wait_job(self, proc: StageProc, timeout_s: float) -> bool:
        deadline = self.host.clock() + timeout_s
        while True:
            info = slurm.query(proc.job_id or "")
            if info.ended or not info.known:
                return True
            if self.host.clock() >= deadline:
                return False
            self.host.sleep(JOB_POLL_S)


def limit_text(limit_s: float | None) -> str:
    """"its 4h time limit", "its 1m time limit", "its 1h30m time limit"."""
    if not limit_s:
        return "its time limit"
    text = fmt_s(limit_s)
    for zero in ("m00s", "h00m"):
        text = text.replace(zero, zero[0])
    return f"its {text} time limit"


def requeues(ws: Workspace, proc: StageProc) -> bool:
    """Whether the stage runs as a Slurm job that is requeued after its time limit, a preemption or its node."""
    job = ws.stage(proc.stage).executor
    return proc.is_job and isinstance(job, SlurmSettings) and job.requeue


def interrupted(ws: Workspace, proc: StageProc) -> str | None:
    """Why a Slurm job that ended was interrupted rather than ended by its stage (its time limit, a preemption,
    its node), when the stage allows a requeue; None otherwise."""
    if not requeues(ws, proc) or proc.stop_requested:
        return None
    limit = limit_text(proc.job_limit_s)
    if proc.job_state == "TIMEOUT":
        return f"reached {limit}"
    if proc.job_state == "PREEMPTED":
        return "was preempted"
    if proc.job_state == "NODE_FAIL":
        where = proc.job_nodes or proc.job_host or ""
        several = "," in where or "[" in where
        return f"lost {'one of its nodes' if several else 'its node'}{f' {where}' if where else ''} (NODE_FAIL)"
    if proc.exit_code == slurm.LIMIT_EXIT:
        return f"stopped at the warning before {limit}"
    return None


def interruption(ws: Workspace, store: Store, proc: StageProc, *, why: str, attempt: int, limit: int,
                 job: str | None, how: str) -> dict:
    """The event's data for a job requeued (`how`: "requeued", the same job id) or submitted again
    ("resubmitted", a new one): why, the step the stage had reached and the one it resumes from (training)."""
    obs = store.latest_observation(proc.stage) or {}
    prog = obs.get("progress") if obs.get("t", 0) >= (proc.started_at or 0) else None
    prog = prog if isinstance(prog, dict) else {}
    out = ws.for_run(proc.run_id).out_dir(proc.stage) if proc.stage == "train" else None
    resume = named_latest(out) if out is not None and out.is_dir() else None
    return {"why": why, "how": how, "job_id": job, "previous_job_id": proc.job_id, "attempt": attempt,
            "limit": limit, "done": prog.get("done"), "total": prog.get("total"), "unit": prog.get("unit"),
            "resume_step": resume}


def _name(proc: StageProc) -> str:
    """The job's name on the cluster: recorded with its row before submission (as `slurm.job_name` makes it)."""
    return proc.job_name or slurm.job_name(proc.run_id or "", proc.stage, proc.id)
