"""What the monitor does after observing: the restart policy, the handoff, due reminders."""

from __future__ import annotations

import time

from pipeline.config import STAGE_NAMES, Workspace
from pipeline.errors import UserError
from pipeline.handoff.machine import Handoff, handoff_state
from pipeline.regenerate import complete as regenerate_complete
from pipeline.stages.slurm_executor import interrupted, interruption
from pipeline.stages.supervisor import Supervisor
from pipeline.states import ARMED, WAITING, StageState, backoff_due, record
from pipeline.store import KV, Store


class Automation:
    """One instance per monitor; `tick()` after each sampler tick."""

    def __init__(self, *, ws: Workspace, store: Store, gpu_probe=None, clock=time.time, **handoff_kw) -> None:
        self.ws, self.store, self.clock = ws, store, clock
        self.sup = Supervisor(workspace=ws, store=store)
        self.handoff = Handoff(ws=ws, store=store, supervisor=self.sup, gpu_probe=gpu_probe, clock=clock, **handoff_kw)

    def tick(self) -> None:
        """Restart what died, start extraction after a verified regeneration, advance the handoff, post due
        reminders."""
        self.restart_policy()
        self.chain()
        self.handoff.tick()
        self.reminders()

    def chain(self) -> None:
        """Regenerate → extract: with auto-start armed for the run, extraction starts by itself once this run's
        regeneration exited 0 and is verified complete (every conversation has its row, the failed ones within
        the handoff's max_failed_share, OUT written whole). The server stays up across the two; only the
        handoff to training stops it. Exactly once: the launch is recorded before it is made, and any
        extraction of this run (started by hand too) ends it."""
        run = self.store.current_run()
        cfg = self.ws.for_run(run).stage("regenerate")
        state = handoff_state(self.store)
        out = self.ws.for_run(run).out_dir("regenerate")
        if not cfg.argv or out is None or run is None or not state or state.step not in (ARMED, WAITING):
            return
        regen = self.store.latest_proc("regenerate", run=run)
        if not regen or regen.state != StageState.EXITED or regen.exit_code != 0:
            return
        key, refused = KV.chain(run, "extract"), KV.chain(run, "refused", regen.id)
        if self.store.latest_proc("extract", run=run) or self.store.get(key) or self.store.get(refused):
            return  # checked once per regeneration: its files do not change after it exited
        ok, why = regenerate_complete(out, max_failed_share=self.ws.config.handoff.max_failed_share)
        if not ok:
            self.store.put(refused, why)
            self.store.add_event(kind="handoff-alert", run_id=run, stage="regenerate", data={
                "reason": f"regeneration exited 0 but is not complete ({why}); extraction not started"})
            return
        self.store.put(key, self.clock())
        try:
            proc = self.sup.start("extract")
        except UserError as exc:
            self.store.add_event(kind="handoff-alert", run_id=run, stage="extract",
                                 data={"reason": f"regeneration is complete but extraction could not start: {exc}"})
            return
        self.store.add_event(kind="chain", run_id=run, stage="extract", data={
            "from": "regenerate", "reason": why, "pid": proc.pid})

    def restart_policy(self) -> None:
        """`on-failure` stages that died (not stopped) restart with doubling backoff, up to their limit. The
        policy's state lives on the process row: its backoff (`restart_due`), its count (`restart_count`, carried
        to the row it starts) and whether it gave up (`restart_given_up`)."""
        for stage in STAGE_NAMES:
            cfg = self.ws.stage(stage)
            proc = self.store.latest_proc(stage)
            if not proc or proc.stop_requested or proc.restart_given_up:
                continue
            why = interrupted(self.ws, proc) if proc.has_ended else None
            if why:
                self._resubmit(proc, why)
                continue
            if cfg.restart != "on-failure":
                continue
            vanished = proc.state == StageState.UNKNOWN and proc.ended_at is not None
            failed = proc.state == StageState.EXITED and proc.exit_code != 0
            if not (vanished or failed):
                continue
            count = proc.restart_count or 0
            if failed and proc.exit_code in cfg.final_exit_codes:
                self._give_up(proc, f"{stage} exited {proc.exit_code} ({proc.reason}): a usage, configuration or "
                                    f"input error that no restart fixes, so it is not restarted; see `eagle3 logs "
                                    f"{stage}`, fix the cause, then `eagle3 start {stage}`")
                continue
            if count >= cfg.max_restarts:
                self._give_up(proc, f"{stage} died ({proc.reason}) and has been restarted {count} time(s), its limit")
                continue
            if proc.restart_due is None:  # its backoff, recorded once
                record(self.store, proc, restart_due=backoff_due(proc.ended_at or self.clock(), cfg.restart_backoff_s,
                                                                 count))
            if self.clock() < proc.restart_due:
                continue
            try:
                new = self.sup.start(stage, restart_count=count + 1)
            except UserError as exc:
                self._give_up(proc, f"cannot restart {stage}: {exc}")
                continue
            self.store.add_event(kind="stage-restart", run_id=proc.run_id, stage=stage, data={
                "attempt": count + 1, "limit": cfg.max_restarts, "reason": proc.reason, "pid": new.pid})

    def _resubmit(self, proc, why: str) -> None:
        """A Slurm job ended by its time limit, a preemption or its node (not by its stage) is submitted again at
        once, whatever the restart policy, up to max_restarts with Slurm's own requeues of it; it resumes from its
        checkpoint. Said once, with the new job's id."""
        cfg = self.ws.stage(proc.stage)
        count = (proc.restart_count or 0) + (proc.job_restarts or 0)
        if count >= cfg.max_restarts:
            self._give_up(proc, f"{proc.stage} {why} (Slurm job {proc.job_id}) and has been requeued or restarted "
                                f"{count} time(s), its max_restarts: not submitted again")
            return
        try:
            new = self.sup.start(proc.stage, restart_count=count + 1)
        except UserError as exc:
            self._give_up(proc, f"{proc.stage} {why} and cannot be submitted again: {exc}")
            return
        data = interruption(self.ws, self.store, proc, why=why, attempt=count + 1, limit=cfg.max_restarts,
                            job=new.job_id, how="resubmitted")
        self.store.add_event(kind="stage-requeued", run_id=proc.run_id, stage=proc.stage, data=data)

    def _give_up(self, proc, reason: str) -> None:
        """The restart policy stops restarting this process's line (said once)."""
        with self.store.atomic():
            self.store.update_proc(proc.id, restart_given_up=1)
            self.store.add_event(kind="restart-limit", run_id=proc.run_id, stage=proc.stage, data={"reason": reason})

    def reminders(self) -> None:
        """Emit a reminder event, with the current status, for each due reminder."""
        pending = self.store.get(KV.REMINDERS, [])
        now = self.clock()
        due = [r for r in pending if r["due_at"] <= now]
        if not due:
            return
        run = self.store.current_run()
        status = {s: v.to_json() for s in STAGE_NAMES if (v := self.store.verdict(s)) is not None}
        with self.store.atomic():
            self.store.put(KV.REMINDERS, [r for r in pending if r["due_at"] > now])
            for r in due:
                if r.get("run") is not None and r["run"] != run:  # asked in a run closed since: not posted into another
                    self.store.add_event(kind="reminder-dropped", run_id=r.get("run"), data={
                        "by": r["by"], "asked_at": r["created_at"], "reason": f"its run {r.get('run')} is closed"})
                    continue
                self.store.add_event(kind="reminder", run_id=run, data={
                    "by": r["by"], "asked_at": r["created_at"], "status": {
                        s: {k: v.get(k) for k in ("verdict", "progress_pct", "eta_s", "reasons")} for s, v in status.items() if v}})
