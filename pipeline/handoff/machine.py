"""The auto-start handoff: verified completion → stop the server → GPUs released → train, once.

The state lives in the store (kv `handoff`), so a restart of the service resumes at
the recorded step. Training is launched exactly once: before launching, the highest
train process id is recorded; a train process above it means the launch happened.
A launch that cannot start (a missing `torchrun`, say) is retried a bounded number of
times with backoff, then the handoff fails with the cause. A handoff belongs to its run:
when a new run opens, the last run's handoff is history and auto-start reads `off`.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

from pipeline.config import Workspace
from pipeline.errors import UserError
from pipeline.handoff import completion
from pipeline.observe.done import finished
from pipeline.stages.host import port_free
from pipeline.stages.slurm_executor import interrupted
from pipeline.stages.supervisor import NO_RUNNER, STOP_GRACE_S, Supervisor
from pipeline.states import (  # the handoff's steps and edges live on the floor, beside StageProc
    ARMED,
    CANCELLED,
    FAILED,
    FOLLOWED,
    GPU_WAIT,
    HANDOFF_EDGES,
    LAUNCHING,
    MAYBE_ALIVE_STATES,
    STOPPING,
    TRAINING,
    TRAINING_DONE,
    TRAINING_FAILED,
    WAITING,
    HandoffState,
    HandoffStep,
    StageProc,
    StageState,
    backoff_due,
)
from pipeline.store import KV, Store
from pipeline.train.export import draft_note

RESTART_WAIT_S = 900.0  # how long a restart by hand may take (its stop waits for a checkpoint) before it is an end
MAX_STEPS_PER_TICK = len(FOLLOWED) + 1  # a tick may walk the whole chain, never loop


def handoff_state(store: Store) -> HandoffState | None:
    """The current run's handoff, or None (auto-start off). A handoff made for another run is
    history once a newer run is open; with no run open, the last one still shows how it ended
    (nothing advances it: completion reads only an open run's stages). One armed while no run was
    open (`run` None) is armed for the next run, which it joins."""
    state = store.handoff()
    return state.of_run(store.current_run()) if state else None


def _shape(reason: str) -> str:
    return re.sub(r"[\d,.]+", "#", reason)


class Handoff:
    """Advances the persisted handoff one step per monitor tick."""

    def __init__(self, *, ws: Workspace, store: Store, supervisor: Supervisor, gpu_probe=None, clock=time.time,
                 port_check=port_free) -> None:
        self.ws, self.store, self.sup, self.gpu, self.clock = ws, store, supervisor, gpu_probe, clock
        self.port_check = port_check

    def state(self) -> HandoffState | None:
        """The current run's handoff, or None when not armed for it."""
        return handoff_state(self.store)

    def _set(self, step: HandoffStep, reason: str, **fields) -> HandoffState:
        """Move the handoff to `step` (or restate it with a new reason), asserting the edge; one event."""
        with self.store.atomic():
            old = self.state() or HandoffState()
            if old.step != step and (old.step, step) not in HANDOFF_EDGES:
                raise AssertionError(f"illegal handoff transition {old.step} -> {step}")
            run = old.run or self.store.current_run()
            state = replace(old, **fields, run=run, step=step, reason=reason, step_at=self.clock())
            self.store.put_handoff(state)
            self.store.add_event(kind="handoff", run_id=run, data={"step": str(step), "reason": reason})
        return state

    def _at(self, step: HandoffStep) -> bool:
        """The handoff is at `step` now (read again: a cancel from another process may have landed)."""
        state = self.state()
        return state is not None and state.step == step

    def _note(self, reason: str, *, step: HandoffStep) -> None:
        """A new reason within the same step. The state always shows the latest numbers; an event
        is recorded only when the kind of reason changes, not each time a count moves. Read and written in one
        transaction: a cancel from another process that lands between them is never written over (a stale
        "launching-training, retrying in 2 s" once put back a cancelled handoff, which then launched)."""
        with self.store.atomic():
            state = self.state()
            if not state or state.step != step or state.reason == reason:
                return  # the step moved on (a cancel) since the caller read it: its news is no longer true
            if _shape(state.reason or "") != _shape(reason):
                self._set(step, reason)
            else:
                self.store.put_handoff(replace(state, reason=reason))

    # --- verbs ------------------------------------------------------------------------------
    def arm(self, *, by: str) -> tuple[bool, HandoffState]:
        """Create the handoff; a second arm is a no-op. Returns (created, state)."""
        with self.store.atomic():
            state, run = self.state(), self.store.current_run()
            if state and state.followed and state.run in (None, run):  # not a closed run's
                return False, state
            self.store.put_handoff(HandoffState(run=run))  # a fresh handoff: nothing of the last one
            return True, self._set(ARMED, f"armed by {by}" + ("" if run else " for the next run"), armed_by=by,
                                   armed_at=self.clock(), for_next_run=run is None)

    def cancel(self, *, by: str) -> tuple[bool, HandoffState | None]:
        """Cancel before a training process exists. Returns (cancelled, state)."""
        with self.store.atomic():
            state = self.state()
            if not state or not state.cancellable:
                return False, state
            return True, self._set(CANCELLED, f"cancelled by {by}")

    # --- the tick -------------------------------------------------------------------------
    def tick(self) -> None:
        """Advance at most a few steps; never raises into the monitor."""
        self._arm_new_run()
        for _ in range(MAX_STEPS_PER_TICK):
            state = self.state()
            if not state or state.step is None or not state.followed:
                return
            before = state.step
            try:
                {ARMED: self._armed, WAITING: self._waiting, STOPPING: self._stopping, GPU_WAIT: self._gpu_wait,
                 LAUNCHING: self._launching, TRAINING: self._training}[before](state)
            except UserError as exc:
                self._set(FAILED, str(exc))
            if (now := self.state()) is not None and now.step == before:
                return

    def _arm_new_run(self) -> None:
        """With `[handoff] autostart = true`, each new run starts armed, unless training was
        already started in it by hand (a resume): auto-start has nothing left to hand off."""
        run = self.store.current_run()
        if (self.ws.config.handoff.autostart and run and self.state() is None
                and self.store.latest_proc("train", run=run) is None):
            self.arm(by="config ([handoff] autostart = true)")

    def _manual_training(self) -> StageProc | None:
        """A live training process of this run that the handoff did not launch (started by hand)."""
        run = self.store.current_run()
        proc = self.store.latest_proc("train", run=run) if run else None
        return proc if proc and proc.state in MAYBE_ALIVE_STATES else None

    def _armed(self, state: HandoffState) -> None:
        if state.run is None and self.store.current_run() is None:
            return  # armed for the next run: nothing to wait for until it opens
        self._set(WAITING, "waiting for verified completion of extraction")

    def _waiting(self, state: HandoffState) -> None:
        if (train := self._manual_training()) is not None:
            how = train.who if train.launched else "being started"
            self._set(CANCELLED, f"training was started by hand and is running ({how}); auto-start stands down")
            return
        c = completion.check(self.ws, self.store, verify_sample=self.ws.config.handoff.verify_sample)
        if not c.complete:
            self._note("waiting: " + "; ".join(c.missing), step=WAITING)
            return
        self._set(STOPPING, f"extraction verified complete ({c.done:,} done, {c.failed or 0:,} failed of {c.total:,})")

    def _stopping(self, state: HandoffState) -> None:
        result = self.sup.stop("server", grace_s=self.ws.config.handoff.server_stop_grace_s)
        how = "was not running" if not result.was_running else (
            "stopped with SIGKILL after the grace period" if result.escalated else "stopped")
        if result.survivors:
            who = ", ".join(f"{m.pid} ({m.name})" for m in result.survivors)
            self.store.add_event(kind="handoff-alert", data={"reason": f"server processes survived SIGKILL: {who}"})
        self._set(GPU_WAIT, f"server {how}; waiting for the training GPUs to be released", gpu_wait_since=self.clock(),
                  server_stopped_at=self.clock())

    def _gpu_wait(self, state: HandoffState) -> None:
        released, why = self._released(state)
        if released:
            floor = max((p.id for p in self.store.procs("train")), default=0)
            self._set(LAUNCHING, why, train_floor=floor)
            return
        waited = self.clock() - (state.gpu_wait_since or self.clock())
        if waited > self.ws.config.handoff.gpu_release_timeout_s:
            reason = f"GPUs not released after {waited:.0f} s: {why}; training not launched"
            self.store.add_event(kind="handoff-alert", data={"reason": reason})
            self._set(FAILED, reason)
        else:
            self._note(f"waiting for GPU release: {why}", step=GPU_WAIT)

    def _released(self, state: HandoffState) -> tuple[bool, str]:
        server = self.store.latest_proc("server")
        if server and server.is_job:  # on a cluster: the server's GPUs are free once its job has left the queue
            if server.state in MAYBE_ALIVE_STATES:
                return False, f"the server's Slurm job {server.job_id} is still {server.state}"
            return True, f"the server's Slurm job {server.job_id} has left the queue ({server.reason})"
        port = self.ws.config.stages.server.port
        if not self.port_check(port):
            return False, f"port {port} still in use"
        reading = self.gpu.read() if self.gpu else None
        if reading is None or reading.unknown:
            settled = self.clock() - (state.server_stopped_at or 0) >= self.ws.config.handoff.settle_s
            why = reading.unknown if reading else "no GPU probe"
            return settled, f"server processes gone and port {port} free; GPU memory could not be checked ({why})"
        baseline = self.store.get(KV.GPU_BASELINE) or {}
        wanted = set(self.ws.stage("train").gpus) or {g["index"] for g in reading.value}
        tol = self.ws.config.handoff.gpu_release_tolerance_mb
        held = [g for g in reading.value if g["index"] in wanted and g.get("mem_used_mb") is not None
                and g["mem_used_mb"] > float(baseline.get(str(g["index"]), 0.0)) + tol]
        if held:
            return False, "memory still held on GPU " + ", ".join(
                f"{g['index']} ({g['mem_used_mb']:.0f} MB)" for g in held)
        return True, f"training GPUs back to their baseline memory and port {port} free"

    def _launching(self, state: HandoffState) -> None:
        floor = state.train_floor or 0

        def rows() -> list[StageProc]:
            return self.store.procs("train", after=floor)

        # Rows above the floor are this handoff's launches (the row `start` inserts is the
        # idempotency record). One with a pid was launched. One without a pid is still being
        # started, or was left by a service killed mid-start: refresh closes it as never started
        # once no runner has taken it up for RUNNER_START_TIMEOUT_S; that is not the command's
        # failure and does not count. Other rows closed without a pid are failed attempts, and
        # attempts are bounded: a command that cannot start never will.
        self.sup.refresh()
        if not any(p.launched or p.state in MAYBE_ALIVE_STATES for p in rows()):
            attempts = [p for p in rows() if NO_RUNNER not in (p.reason or "")]
            cfg = self.ws.config.handoff
            if len(attempts) >= cfg.launch_attempts:
                reason = (f"training could not be started after {len(attempts)} attempt(s): "
                          f"{attempts[-1].reason}; fix stages.train.argv, then `eagle3 autostart on`")
                self.store.add_event(kind="handoff-alert", run_id=self.store.current_run(), data={"reason": reason})
                self._set(FAILED, reason)
                return
            if attempts:
                due = backoff_due(attempts[-1].ended_at or 0, cfg.launch_backoff_s, len(attempts) - 1)
                if self.clock() < due:
                    self._note(f"launch attempt {len(attempts)} of {cfg.launch_attempts} failed "
                               f"({attempts[-1].reason}); retrying in {due - self.clock():.0f} s", step=LAUNCHING)
                    return
            # checked in the insert's transaction: a cancel that landed since this tick read the step wins
            if self.sup.start("train", only_if=lambda: self._at(LAUNCHING)) is None:
                return
        started = [p for p in rows() if p.launched]
        if not started:
            self._note("waiting for the training runner to report its pid", step=LAUNCHING)
            return
        with self.store.atomic():  # the same transaction as a cancel's check: one of the two wins
            if self._at(LAUNCHING):
                self._set(TRAINING, f"training launched ({started[0].who})", train_proc_id=started[0].id)
                return
        # Cancelled while the launch was under way: the operator was told no training would run.
        self.sup.stop("train", grace_s=STOP_GRACE_S)
        self.store.add_event(kind="handoff", run_id=self.store.current_run(), data={
            "step": CANCELLED, "reason": f"training ({started[0].who}) stopped: auto-start was "
                                         "cancelled while it was being launched"})

    def _draft_note(self, run: str | None) -> str:
        """Where the trainer exported the draft, and SGLang's launch line for it ('' when there is none)."""
        ws = self.ws.for_run(run)
        train = ws.config.stages.train
        return draft_note(ws.resolve(train.out), train.argv, cwd=ws.resolve(train.cwd) or ws.root)

    def _training(self, state: HandoffState) -> None:
        """Follow training to its end: the handoff ends `training-done` or `training-failed`."""
        self.sup.refresh()
        proc = self.store.proc(state.train_proc_id or 0)
        if not proc or (proc.state in MAYBE_ALIVE_STATES and proc.ended_at is None):
            return
        latest = self.store.latest_proc("train", run=proc.run_id)
        if latest is not None and latest.id != proc.id:  # restarted (by hand or by the restart policy): follow it
            self._set(TRAINING, f"training restarted ({latest.who}); auto-start follows it to its end",
                      train_proc_id=latest.id)
            return
        restarting = self.store.get(KV.restarting("train")) or {}
        if proc.stop_requested and restarting.get("of") == proc.id and \
                self.clock() - restarting.get("t", 0) < RESTART_WAIT_S:
            return  # a restart by hand: the next tick follows the process it starts
        if interrupted(self.ws, proc) and not proc.restart_given_up:
            return  # its time limit, a preemption or its node: the restart policy submits it again next tick
        if proc.stop_requested:
            self._set(CANCELLED, f"training stopped on request ({proc.reason})")
        elif proc.state == StageState.EXITED and proc.exit_code == 0:
            why = finished(self.ws.for_run(proc.run_id), "train", clock=self.store.clock)
            if why:
                self._set(TRAINING_FAILED, f"training {why}")
            else:
                self._set(TRAINING_DONE, "training finished (exit 0)" + self._draft_note(proc.run_id))
        else:
            self._set(TRAINING_FAILED, f"training ended: {proc.reason}")
