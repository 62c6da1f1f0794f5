"""The controller: the only door into the pipeline for the CLI and the bot."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.config import REQUIRED_STAGES, STAGE_NAMES, Workspace, find_config, load_workspace
from pipeline.errors import StageError, UserError
from pipeline.handoff import completion
from pipeline.handoff.machine import Handoff, handoff_state
from pipeline.observe import forensics
from pipeline.observe.probes.remote import run_on_nodes
from pipeline.stages.logfile import tail_lines
from pipeline.stages.slurm import is_local_host
from pipeline.stages.supervisor import STOP_GRACE_S, StopResult, Supervisor
from pipeline.states import MAYBE_ALIVE_STATES, HandoffState, StageProc, StageState, StateVersion
from pipeline.status import READING_KEYS, AutostartResult, RunStatus, StageStatus
from pipeline.store import KV, Store
from pipeline.train.outdir import set_aside
from pipeline.verdict import StoredVerdict, Verdict

RESTART_BY_HAND = "restart-by-hand"  # the event a restart asked for by a person leaves (counted in the metrics)


class TrainGuardError(UserError):
    """Training was asked for before extraction is verified complete."""

    def __init__(self, c: completion.Completion) -> None:
        super().__init__("; ".join(c.missing))
        self.completion = c


class ServerHoldsGpusError(UserError):
    """Training was asked for while the SGLang server holds GPUs that training needs."""

    def __init__(self, *, pid: int | None, gpus: list[int]) -> None:
        super().__init__(f"the SGLang server (pid {pid}) is running and holds GPU {', '.join(map(str, gpus)) or 'all'}")
        self.pid = pid
        self.gpus = gpus


def refuse_foreign_root(state_dir: Path, *, euid: int, env) -> None:
    """Root in a workspace whose state another account owns (the service's `eagle3` user) would leave
    root-owned store files and logs that the service can no longer write: refused, unless asked."""
    try:
        owner = state_dir.stat().st_uid
    except OSError:
        return
    if euid != 0 or owner == 0 or env.get("EAGLE3_ALLOW_ROOT") == "1":
        return
    import pwd

    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = f"uid {owner}"
    raise UserError(f"{state_dir} belongs to {name}, but this command runs as root: the store and logs it writes "
                    f"would be root's, and the service could no longer write them. Run it as {name} "
                    f"(`sudo -u {name} eagle3 …`), or set EAGLE3_ALLOW_ROOT=1 if you mean it")


class Controller:
    """Verbs over one workspace: start, stop, status, logs."""

    def __init__(self, *, workspace: Workspace, store: Store | None = None, host=None,
                 check_integrity: bool = True) -> None:
        self.ws = workspace
        self._owns_store = store is None  # a store handed in belongs to the caller, who closes it
        self.store = store or Store(workspace.store_path, check_integrity=check_integrity)
        self._host = host

    @functools.cached_property
    def supervisor(self) -> Supervisor:
        """Made when a verb first acts on a stage: read-only verbs (status, eta, gpus…) build no supervisor, host
        or Slurm executor."""
        return Supervisor(workspace=self.ws, store=self.store, host=self._host)

    @classmethod
    def open(cls, config: str | None) -> Controller:
        """Find the config, load it and open its store (refusing root in a workspace another account owns)."""
        ws = load_workspace(find_config(config))
        refuse_foreign_root(ws.state_dir, euid=os.geteuid(), env=os.environ)
        return cls(workspace=ws)

    def close(self) -> None:
        """Release the store (if this controller opened it)."""
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_stage(self, stage: str) -> None:
        if stage not in STAGE_NAMES:
            raise StageError(f"unknown stage {stage!r}; choose one of {', '.join(STAGE_NAMES)}")

    def start(self, stage: str, *, force: bool = False, fresh: bool = False, by: str = "cli") -> StageProc:
        """Start a stage; training only once extraction is verified complete (or forced, audited).
        Training resumes from its --out's checkpoint; `fresh` moves an earlier training's files aside
        first (OUT/previous/<time>/), so that it starts at step 1."""
        self._check_stage(stage)
        if fresh and stage != "train":
            raise UserError(f"--fresh is for training (it moves stages.train.out's checkpoints aside), not {stage}")
        reopen = None
        if stage == "train":
            c = completion.check(self.ws, self.store, verify_sample=self.ws.config.handoff.verify_sample)
            if c.run is None and (closed := self.store.last_closed_run()):
                # no run open (training finished, or `stop --all`): train on the last run's extraction when it is
                # verified complete, reopening that run; otherwise say which run was looked at and why not
                earlier = completion.check(self.ws, self.store, verify_sample=self.ws.config.handoff.verify_sample,
                                           run=closed[0])
                if earlier.complete:
                    c, reopen = earlier, closed
                else:
                    c.missing = [f"no run is open, and the last run {closed[0]} (closed: {closed[1]}) has no verified "
                                 f"extraction ({'; '.join(earlier.missing)}); `eagle3 start extract` opens a new run"]
            if not c.complete and not force:
                self.store.audit(user=by, channel=None, action="start train", outcome="refused", detail="; ".join(c.missing))
                c.autostart_armed = (state := handoff_state(self.store)) is not None and state.cancellable
                raise TrainGuardError(c)
            if not c.complete:
                self.store.audit(user=by, channel=None, action="start train --force", outcome="allowed",
                                 detail="; ".join(c.missing))
            self._guard_server_gpus(force=force, by=by)
        if stage == "server":
            self._record_gpu_baseline()
        if reopen:  # after every guard: a refused start reopens nothing
            self.store.reopen_run(reopen[0], reason=f"start train by {by}: training on its verified extraction")
        moved = self._set_training_aside(by=by) if fresh else None
        proc = self.supervisor.start(stage)
        proc.set_aside = str(moved) if moved else None
        proc.reopened = reopen[0] if reopen else None
        return proc

    def _set_training_aside(self, *, by: str) -> Path | None:
        """`start train --fresh`: the earlier training's checkpoints, progress and draft go to
        OUT/previous/<time>/ (bounded: outdir.trim_previous), unless training is running."""
        self.supervisor.refresh()
        proc = self.store.latest_proc("train")
        if proc and proc.state in MAYBE_ALIVE_STATES:
            raise StageError(f"train is {proc.state}: stop it first (`eagle3 stop train`), then start it --fresh")
        # with `{run}` in the path, the open run's own training (a run opened by this start has none yet)
        ws = self.ws.for_run(self.store.current_run())
        out = ws.out_dir("train")
        if out is None:
            raise UserError("--fresh needs stages.train.out (the trainer's --out) in the config, to know what "
                            "to move aside")
        moved = set_aside(out)
        self.store.audit(user=by, channel=None, action="start train --fresh", outcome="done",
                         detail=f"moved to {moved}" if moved else "nothing to move")
        return moved

    def _guard_server_gpus(self, *, force: bool, by: str) -> None:
        """Training beside a server that holds its GPUs competes for their memory: refused
        (the handoff is the way: stop the server, wait for the release, launch), or forced, audited."""
        self.supervisor.refresh()
        proc = self.store.latest_proc("server")
        if not proc or proc.state not in MAYBE_ALIVE_STATES:
            return
        if proc.is_job and self.ws.stage("train").on_slurm:
            return  # two jobs: Slurm gives each its own GPUs
        server, train = set(self.ws.stage("server").gpus), set(self.ws.stage("train").gpus)
        if server and train and not server & train:
            return
        err = ServerHoldsGpusError(pid=proc.pid, gpus=sorted(server & train if server and train else server | train))
        self.store.audit(user=by, channel=None, action="start train" + (" --force" if force else ""),
                         outcome="allowed" if force else "refused", detail=str(err))
        if not force:
            raise err

    def _record_gpu_baseline(self) -> None:
        """GPU memory before the server loads: the handoff waits for the training GPUs to return to it."""
        from pipeline.observe.sampler import make_gpu_probe

        reading = make_gpu_probe(self.ws).read()
        if reading.value:
            self.store.put(KV.GPU_BASELINE, {str(g["index"]): g["mem_used_mb"] for g in reading.value})

    def autostart(self, on: bool, *, by: str = "cli") -> AutostartResult:
        """Arm or cancel the handoff."""
        h = Handoff(ws=self.ws, store=self.store, supervisor=self.supervisor)
        changed, state = h.arm(by=by) if on else h.cancel(by=by)
        self.store.audit(user=by, channel=None, action=f"autostart {'on' if on else 'off'}",
                         outcome="done" if changed else "no-op", detail=str(state.step if state and state.step else "off"))
        return AutostartResult(on=on, changed=changed, state=state, monitor_running=self.monitor_running())

    def snooze(self, stage: str, *, seconds: float = 3600.0, by: str = "cli") -> float:
        """Silence alerts about `stage` until now + seconds; returns the time they resume."""
        self._check_stage(stage)
        until = self.store.clock() + seconds
        self.store.put(KV.snooze(stage), until)
        return until

    def acknowledge(self, stage: str, *, by: str) -> float:
        """Someone took the stage's alert: recorded (and audited by the caller), and it is not escalated."""
        self._check_stage(stage)
        now = self.store.clock()
        with self.store.atomic():
            self.store.put(KV.acked(stage), {"by": by, "t": now})
            self.store.add_event(kind="acknowledged", run_id=self.store.current_run(), stage=stage, data={"by": by})
        return now

    def remind(self, spec: str, *, by: str = "cli") -> dict:
        """Store a reminder due after '30m', '1h', '90s' or at the extraction 'eta'."""
        now = self.store.clock()
        if spec == "eta":
            eta = self.running_eta()
            if eta is None:
                raise UserError("remind eta: no running stage has an ETA yet; give a delay such as 30m or 1h")
            delay = float(eta)
        else:
            m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|m|h)", spec.strip())
            if not m:
                raise UserError(f"remind {spec!r}: give a delay such as 30m, 1h or 90s, or 'eta'")
            delay = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
        reminder = {"due_at": now + delay, "created_at": now, "by": by, "spec": spec, "run": self.store.current_run()}
        with self.store.atomic():
            self.store.put(KV.REMINDERS, [*self.store.get(KV.REMINDERS, []), reminder])
            self.store.audit(user=by, channel=None, action=f"remind {spec}", outcome="done")
        return {**reminder, "monitor_running": self.monitor_running()}

    def audit(self, *, user: str, channel: str | None, action: str, outcome: str, detail: str | None = None) -> None:
        """Record who asked for what through chat, and how it ended (done, refused, stale, accepted…)."""
        self.store.audit(user=user, channel=channel, action=action, outcome=outcome, detail=detail or "")

    def training_running(self) -> bool:
        """Training's latest process may be alive (from the store: no probe)."""
        proc = self.store.latest_proc("train")
        return proc is not None and proc.maybe_alive

    def extraction_looks_complete(self) -> bool:
        """The cheap half of verified completion (the store and the manifest, no sample files opened): fast
        enough to answer within Slack's 3 s; `start("train")` runs the whole check."""
        return completion.check(self.ws, self.store, run_verify=False).complete

    def latest_chart(self) -> dict | None:
        """The last chart posted to Slack ({file_id, stage, t, path}), or None."""
        return self.store.get(KV.CHART_LATEST)

    def recent_events(self, limit: int = 50) -> list[dict]:
        """The newest events, for App Home's timeline."""
        return self.store.recent_events(limit)

    def running_eta(self) -> float | None:
        """The ETA of the furthest stage that is running and has one (training, then extraction, then
        regeneration): "check back later" while training runs is about training, not extraction's 0."""
        for stage in ("train", "extract", "regenerate"):
            proc, v = self.store.latest_proc(stage), self.store.verdict(stage)
            if proc and proc.maybe_alive and v is not None and v.proc_id == proc.id and v.eta_s:
                return float(v.eta_s)
        return None

    @staticmethod
    def owner(proc: StageProc) -> str:
        """Who runs a stage process, in words ('pid 4242' or 'Slurm job 17 on gpu-017')."""
        return proc.who

    def request_chart(self, stage: str, *, by: str = "cli") -> dict:
        """Ask for a stage's chart in the run's thread: an event the notifier turns into an upload
        (rendered when it is delivered, so an outage posts the latest picture, not a stale one)."""
        self._check_stage(stage)
        if self.store.latest_observation(stage) is None:
            raise UserError(f"chart {stage}: nothing observed of {stage} yet; " + (
                f"{stage} has not been started (a chart draws what the monitor observed of a stage)"
                if self.monitor_running() else "is `eagle3 serve` running? It observes the stages"))
        run = self.store.latest_run()
        self.store.add_event(kind="chart-request", run_id=run, stage=stage, data={"by": by})
        return {"stage": stage, "run": run, "monitor_running": self.monitor_running()}

    def request_stacks(self, stage: str, *, by: str = "cli") -> dict:
        """Ask for `eagle3 why STAGE`'s evidence in the stage's alert thread (or the run's): an event the notifier
        gathers from beside the monitor's tick (Show stacks)."""
        self._check_stage(stage)
        run = self.store.latest_run()
        self.store.add_event(kind="stacks-request", run_id=run, stage=stage, data={"by": by})
        return {"stage": stage, "run": run}

    def stop(self, stage: str, *, grace_s: float | None = None, by: str = "cli") -> StopResult:
        """Stop one stage (SIGTERM, grace, SIGKILL). Stopping training also cancels an auto-start
        that has not launched it yet: otherwise the handoff would launch it again."""
        self._check_stage(stage)
        cancelled = self._cancel_handoff(by=f"{by} (stop train)") if stage == "train" else False
        result = self.supervisor.stop(stage, grace_s=self._grace(stage, grace_s))
        if cancelled:
            result.note = "; ".join(filter(None, [result.note, "auto-start cancelled"]))
        return result

    def restart(self, stage: str, *, by: str = "cli") -> tuple[StopResult, StageProc]:
        """Stop a stage and start it again, as one act: auto-start following training keeps following it (the
        stop of a restart is not the training's end)."""
        self._check_stage(stage)
        old = self.store.latest_proc(stage)
        self.store.put(KV.restarting(stage), {"of": old.id if old else None, "t": self.store.clock()})
        self.store.add_event(kind=RESTART_BY_HAND, run_id=self.store.current_run(), stage=stage, data={"by": by})
        try:
            return self.stop(stage, by=by), self.start(stage, by=by)
        finally:
            self.store.put(KV.restarting(stage), None)

    def stop_all(self, *, grace_s: float | None = None, by: str = "cli") -> list[StopResult]:
        """Stop every stage and close the run (its auto-start is cancelled first)."""
        cancelled = self._cancel_handoff(by=f"{by} (stop --all)")
        results = self.supervisor.stop_all(grace_s=self._grace("server", grace_s))
        if cancelled:
            results[0].note = "; ".join(filter(None, [results[0].note, "auto-start cancelled"]))
        return results

    def _cancel_handoff(self, *, by: str) -> bool:
        return Handoff(ws=self.ws, store=self.store, supervisor=self.supervisor).cancel(by=by)[0]

    def _grace(self, stage: str, grace_s: float | None) -> float:
        if grace_s is not None:
            return grace_s
        return self.ws.config.handoff.server_stop_grace_s if stage == "server" else STOP_GRACE_S

    def last_tick(self) -> float | None:
        """Unix time of the monitor's last heartbeat (None: never, or `eagle3 serve` stopped cleanly)."""
        t = (self.store.get(KV.MONITOR) or {}).get("t")
        return float(t) if t else None

    def restarts(self, stage: str) -> dict[str, int]:
        """Restarts of `stage` in the current run: by its on-failure policy, and by hand (`eagle3 restart`, the
        Slack verb)."""
        run = self.store.current_run()
        if not run:
            return {"policy": 0, "hand": 0}
        return {"policy": sum(1 for p in self.store.procs(stage) if p.run_id == run and p.restart_count),
                "hand": sum(1 for e in self.store.events(kind=RESTART_BY_HAND)
                            if e["run_id"] == run and e["stage"] == stage)}

    def monitor_running(self) -> bool:
        """True when `eagle3 serve` stored a heartbeat within the last two ticks."""
        return self._beating(self.store.get(KV.MONITOR))

    def _beating(self, beat: dict | None) -> bool:
        return self.store.clock() - (beat or {}).get("t", 0) <= 2 * self.ws.config.monitor.tick_s + 1

    def status(self, *, sample_if_unmonitored: bool = True) -> RunStatus:
        """The status object of `eagle3 status --json`, from the store.

        With no monitor running, stages that are running are sampled once here (within
        the probe budget) so the answer is never older than this call. With
        `sample_if_unmonitored=False` (the Slack request path) it only reads the store:
        the monitor keeps it current every tick.
        """
        if sample_if_unmonitored:
            self.supervisor.refresh()
        if sample_if_unmonitored and not self.monitor_running() and any(
                self.supervisor.is_running(s) or self._unobserved_end(s) for s in STAGE_NAMES):
            from pipeline.observe.sampler import Sampler

            sampler = Sampler(ws=self.ws, store=self.store)
            try:
                sampler.tick()
            finally:
                sampler.close()
        # what the answer shows, read in a few batched reads: every stage's latest process at once, the kv entries
        # (heartbeat, handoff, transport, Slack's auth, config, each stage's verdict) at once, the run, the outbox
        now = self.store.clock()
        procs = self.store.latest_procs()
        kv = self.store.get_many([KV.MONITOR, KV.HANDOFF, KV.TRANSPORT, KV.SLACK_AUTH, KV.CONFIG_CHANGED,
                                  *(KV.verdict(s) for s in STAGE_NAMES)])
        run = self.store.current_run()
        monitored = self._beating(kv.get(KV.MONITOR))
        stored = HandoffState.from_json(kv.get(KV.HANDOFF))
        handoff = stored.of_run(run) if stored else None
        transport = kv.get(KV.TRANSPORT)
        return RunStatus(
            run=run, monitor="running" if monitored else "not running",
            autostart=handoff.shown if handoff else "off", autostart_reason=handoff.reason if handoff else None,
            handoff=handoff.step if handoff else None, outbox=self.store.outbox_summary(),
            transport=transport if transport and monitored and transport.get("state") != "stopped" else None,
            slack_auth=kv.get(KV.SLACK_AUTH) if monitored else None,
            config_changed=kv.get(KV.CONFIG_CHANGED) if monitored else None,
            version=StateVersion(run=run, step=handoff.step if handoff else None),
            stages={stage: self._stage_status(stage, now, procs.get(stage),
                                              StoredVerdict.from_json(kv.get(KV.verdict(stage))))
                    for stage in STAGE_NAMES if self._shown(stage, procs)})

    def _shown(self, stage: str, procs: dict[str, StageProc]) -> bool:
        """Status shows server, extract and train always; the optional regenerate once configured or run."""
        return stage in REQUIRED_STAGES or bool(self.ws.stage(stage).argv) or stage in procs

    def _unobserved_end(self, stage: str) -> bool:
        proc = self.store.latest_proc(stage)
        verdict = self.store.verdict(stage)
        return proc is not None and proc.state != StageState.RUNNING and (
            verdict is None or verdict.proc_id != proc.id or not verdict.final)

    def _stage_status(self, stage: str, now: float, proc: StageProc | None, v: StoredVerdict | None) -> StageStatus:
        if not proc:
            return StageStatus(state=StageState.NOT_STARTED, log=str(self.ws.log_path(stage)))
        running = proc.state == StageState.RUNNING
        st = StageStatus(
            state=proc.state, pid=proc.pid, exit_code=proc.exit_code, signal=proc.signal,
            started_at=proc.started_at, ended_at=proc.ended_at,
            uptime_s=round(now - proc.started_at, 1) if running and proc.started_at else None,
            log=proc.log or str(self.ws.log_path(stage)), reason=proc.reason, run=proc.run_id, stop_requested=bool(proc.stop_requested),
            job=proc.job_id if proc.is_job else None, nodes=(proc.job_nodes or proc.job_host) if proc.is_job else None,
            out=self._out(stage, proc.run_id))
        return self._with_verdict(stage, proc, st, v)

    def _out(self, stage: str, run: str | None) -> str | None:
        """The stage's configured output as `run` sees it (`{run}` expanded), or None."""
        out = self.ws.for_run(run).out_dir(stage)
        return str(out) if out else None

    def _with_verdict(self, stage: str, proc: StageProc, st: StageStatus, v: StoredVerdict | None) -> StageStatus:
        alive = proc.state in MAYBE_ALIVE_STATES
        if not v or v.proc_id != proc.id:
            said = (Verdict.STARTING, "just started; not observed yet") if alive and proc.state != StageState.UNKNOWN \
                else (Verdict.UNKNOWN, f"ended ({proc.reason or proc.state}); not observed since" if proc.ended_at
                      else "not observed yet")  # just started: the next tick observes it
            return replace(st, diagnosis=StoredVerdict(t=self.store.clock(), stage=stage, verdict=said[0],
                                                       reasons=(said[1],)))
        if not alive and not v.final and v.verdict not in (Verdict.STOPPED, Verdict.DONE, Verdict.DEAD):
            # The verdict was made while it ran; until the next tick observes the end, say what is known.
            stopped = proc.state == StageState.STOPPED
            why = (f"stopped on request ({proc.reason})" if proc.stop_requested else proc.reason) if stopped \
                else f"ended ({proc.reason}); its verdict comes with the next observation"
            why = why or "stopped on request"
            v = replace(v, verdict=Verdict.STOPPED if stopped else Verdict.UNKNOWN, eta_s=None,
                        eta_low_s=None, eta_high_s=None, reasons=(why,))
        obs = self.store.latest_observation(stage) or {}
        readings: dict[str, Any] = {k: obs.get(k) for k in READING_KEYS}
        remote = (obs.get("process") or {}).get("remote") if proc.is_job else None
        read = {"via": remote.get("via"), "age_s": remote.get("age_s")} if isinstance(remote, dict) else None
        return replace(st, observed=True, diagnosis=v, gaps=obs.get("unknown"), read=read, **readings)

    def state_version(self) -> StateVersion:
        """What a button was rendered against: the run and the handoff step (a stale button changes nothing)."""
        handoff = handoff_state(self.store)
        return StateVersion(run=self.store.current_run(), step=handoff.step if handoff else None)

    def why(self, stage: str, *, native: bool = False):
        """"Why is it stuck?": the stage's processes' stacks, the server's own view and the log's end, gathered now
        and kept under STATE_DIR/forensics/ (pipeline/observe/forensics.py); returns (the evidence, its file)."""
        self._check_stage(stage)
        proc = self.store.latest_proc(stage)
        run = proc.run_id if proc else None
        ev = forensics.gather(self.ws.for_run(run), self.store, stage, native=native)
        return ev, forensics.keep(self.ws, ev, run)

    def logs(self, stage: str, *, lines: int = 50, on_node: bool = False) -> tuple[Path, list[str]]:
        """The last lines of a stage's log. `on_node` (the CLI's): for a running Slurm job on another host, read where
        its batch script runs, through `srun --overlap` (its log may be on that node's disk only); never asked on
        Slack's request path, which reads this host's copy without waiting on the cluster."""
        self._check_stage(stage)
        proc = self.store.latest_proc(stage)
        path = self.ws.for_run(proc.run_id if proc else None).log_path(stage)
        remote = on_node and proc is not None and proc.is_job and proc.state == StageState.RUNNING \
            and bool(proc.job_host) and not is_local_host(proc.job_host)
        if not remote or proc is None or proc.job_host is None:
            return path, tail_lines(path, lines)
        got = run_on_nodes(proc.job_id or "", proc.job_host, ["--tail", str(path), "--lines", str(lines)])
        if isinstance(got, list) and "lines" in got[0]:
            return path, got[0]["lines"]
        if path.exists():  # a shared filesystem: the same file, read here
            return path, tail_lines(path, lines)
        raise UserError(f"{stage}: {path} is not on this host, and reading it on {proc.job_host} failed: "
                        f"{got if isinstance(got, str) else got[0].get('error')}")
