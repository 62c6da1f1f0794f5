"""The sampler: every tick, one observation per stage, its verdict, and verdict events.

Probes run in worker threads under one time budget per tick: a probe stuck on a
stalled filesystem yields unknown for that reading, and is not started again
while its previous call still hangs. Nothing here runs on a Slack request path.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from pipeline.config import STAGE_NAMES, Workspace
from pipeline.layout import lines_dir
from pipeline.observe.diagnosis import Diagnoser
from pipeline.observe.done import evidence, progress_call
from pipeline.observe.probes import Reading, unknown
from pipeline.observe.probes.disk import projected_need, read_disk
from pipeline.observe.probes.files import FileScanner
from pipeline.observe.probes.gpu import GpuProbe, nvml_or_fake
from pipeline.observe.probes.process import group_processes, read_process
from pipeline.observe.probes.remote import RemoteProbe
from pipeline.observe.probes.server import ServerProbe
from pipeline.stages.slurm import is_local_host
from pipeline.stages.slurm_executor import interrupted, limit_text, requeues
from pipeline.stages.supervisor import Supervisor
from pipeline.states import StageProc, StageState
from pipeline.store import KV, Store
from pipeline.verdict import Policy, StoredVerdict, VerdictRecord, fmt_bytes, fmt_s

HISTORY_S = 7200.0  # history replayed into a fresh diagnoser after a restart


def make_gpu_probe(ws: Workspace, *, clock=time.time) -> GpuProbe:
    """NVML, or scripted idle fake GPUs when `[monitor] fake_gpus` is set (tests, demo)."""
    return nvml_or_fake(ws.config.monitor.fake_gpus, clock=clock)


class _Budget:
    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self.pending: dict = {}

    def gather(self, calls: dict, budget_s: float, clock) -> dict[str, Reading]:
        futures, out = {}, {}
        for key, fn in calls.items():
            prev = self.pending.get(key)
            if prev is not None and not prev.done():
                out[key] = unknown(f"{key}: the previous reading has not returned (stalled filesystem or server?)")
                continue
            futures[key] = self.pending[key] = self.pool.submit(fn)
        deadline = time.monotonic() + budget_s
        for key, fut in futures.items():
            try:
                out[key] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                out[key] = unknown(f"{key}: no reading within the {budget_s:g} s budget")
            except Exception as exc:  # noqa: BLE001 - a probe never raises into the tick
                out[key] = unknown(f"{key}: probe failed ({type(exc).__name__}: {exc})")
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Sampler:
    """Observes every stage of a workspace once per tick."""

    def __init__(self, *, ws: Workspace, store: Store, gpu_probe: GpuProbe | None = None, clock=time.time) -> None:
        self.ws, self.store, self.clock = ws, store, clock
        self.supervisor = Supervisor(workspace=ws, store=store)
        cfg = ws.config
        self.gpu = gpu_probe or make_gpu_probe(ws, clock=clock)
        self.policy = Policy(stall_floor_s=cfg.monitor.stall_floor_s, max_failed_share=cfg.handoff.max_failed_share)
        self.budget = _Budget()
        self.server = ServerProbe(cfg.stages.server.url, clock=clock)
        self.remote = RemoteProbe(every_s=cfg.monitor.remote_every_s, fake_gpus=cfg.monitor.fake_gpus, clock=clock)
        self.scanners: dict[str, tuple[Path, FileScanner]] = {}
        self.readers: dict = {}  # incremental progress readers (a log tail, event files), one per stage
        self.reader_runs: dict[str, str | None] = {}  # the run each stage's readers were made for
        self.diagnosers: dict[str, tuple[int, Diagnoser]] = {}
        self.finished: dict[str, int] = {}  # stage -> proc id whose end was already observed
        self.last_thin = 0.0

    def close(self) -> None:
        """Stop probe threads and HTTP clients."""
        self.budget.close()
        self.server.close()

    # --- per stage sources -----------------------------------------------------
    @staticmethod
    def _files_dir(ws: Workspace, stage: str) -> Path | None:
        cfg = ws.stage(stage)
        if cfg.files_dir:
            return ws.resolve(cfg.files_dir)
        out = ws.out_dir(stage)
        if out is None:
            return None
        if stage == "regenerate":
            return lines_dir(out)
        return out / "hidden_states" if stage == "extract" else out

    def _judged(self, stage: str, row: StageProc) -> bool:
        """Whether this ended process's final verdict is stored already (by this service before a restart): a
        restarted service, or one whose config changed since, does not judge a finished stage again."""
        v = self.store.verdict(stage)
        return v is not None and v.proc_id == row.id and v.final

    def _scanner(self, stage: str, fdir: Path, ws: Workspace) -> FileScanner:
        """The stage's file scanner, a new one when its directory is another (`{run}` in it, a new run)."""
        held = self.scanners.get(stage)
        if held is None or held[0] != fdir:
            held = self.scanners[stage] = (fdir, FileScanner(str(fdir), suffix=ws.stage(stage).files_suffix,
                                                             budget_s=ws.config.monitor.probe_budget_s))
        return held[1]

    def _run_of(self, stage: str, row: StageProc) -> Workspace:
        """The workspace as the row's run sees it; a stage's incremental readers start over with each run (a
        new run's progress is never read from where an earlier run's reader had got to)."""
        if self.reader_runs.get(stage) != row.run_id:
            self.readers.pop(stage, None)
            self.reader_runs[stage] = row.run_id
        return self.ws.for_run(row.run_id)

    # --- the tick --------------------------------------------------------------
    def tick(self) -> dict[str, tuple[dict, VerdictRecord]]:
        """Observe, diagnose and record every active stage; returns {stage: (observation, verdict)}."""
        self.supervisor.refresh()
        rows = {s: self.store.latest_proc(s) for s in STAGE_NAMES}
        for s, r in rows.items():
            if r and r.has_ended and self.finished.get(s) != r.id and self._judged(s, r):
                self.finished[s] = r.id  # judged at its end under the settings it ran with: never judged again
        active = {s: r for s, r in rows.items() if r and self.finished.get(s) != r.id}
        if not active:
            return {}
        pid_stage = {}
        for stage, row in active.items():
            if row.state == StageState.RUNNING and row.pgid:
                pid_stage.update({p.pid: stage for p in group_processes(row.pgid, row.create_time or 0)})
        calls = {"gpus": lambda: self.gpu.read(pid_stage)}
        if {"server", "regenerate", "extract"} & set(active):
            calls["server"] = self.server.read
        bound = {stage: self._run_of(stage, row) for stage, row in active.items()}
        for stage, row in active.items():
            fdir = self._files_dir(bound[stage], stage)
            if row.is_job and row.state == StageState.RUNNING and row.job_id:  # read on the job's own nodes
                calls[f"{stage}.process"] = functools.partial(
                    self.remote.read, row, files_dir=str(fdir) if fdir else None,
                    suffix=bound[stage].stage(stage).files_suffix)
            else:
                calls[f"{stage}.process"] = functools.partial(read_process, row, clock=self.clock)
            if fdir is not None:
                calls[f"{stage}.files"] = self._scanner(stage, fdir, bound[stage]).scan
        self.remote.forget({r.job_id for r in active.values() if r.job_id})
        readings = self.budget.gather(calls, self.ws.config.monitor.probe_budget_s, self.clock)
        second = {}
        for stage in active:
            fn = progress_call(bound[stage], stage, _value(readings.get(f"{stage}.files")), clock=self.clock,
                               readers=self.readers, run=active[stage].run_id)
            if fn:
                second[f"{stage}.progress"] = fn
        readings.update(self.budget.gather(second, self.ws.config.monitor.probe_budget_s, self.clock))
        out = {stage: self._record(stage, row, readings) for stage, row in active.items()}
        self._maybe_thin()
        return out

    def _record(self, stage: str, row: StageProc, readings: dict[str, Reading]) -> tuple[dict, VerdictRecord]:
        now = self.clock()
        obs: dict = {"t": now, "stage": stage}
        sections = {"process": f"{stage}.process", "progress": f"{stage}.progress", "files": f"{stage}.files",
                    "gpus": "gpus", "server": "server" if stage in ("server", "regenerate", "extract") else None}
        remote = _remote_parts(readings.get(f"{stage}.process"))
        for section, key in sections.items():
            reading = readings.get(key) if key else None
            if reading is None:
                continue
            if section == "gpus" and row.is_job and is_local_host(row.job_nodes or row.job_host) is not True:
                where = f"runs on {row.job_nodes or row.job_host}" if row.job_host else "has no node yet"
                reading = Reading(t=reading.t, value=remote[0], unknown=None if remote[0] is not None else (
                    f"remote: Slurm job {row.job_id} {where}; " + (remote[1] or "its nodes have not been read")))
            if section == "files" and reading.unknown and (seen := _node_files(obs.get("process"), row.job_host)):
                reading = Reading(t=reading.t, value=seen)  # a directory this host does not see: as its node counts it
            obs[section] = reading.value
            if reading.unknown:
                obs.setdefault("unknown", {})[section] = reading.unknown
        if row.has_ended and isinstance(obs.get("process"), dict) and (why := interrupted(self.ws, row)):
            obs["process"]["interrupted"] = why
        if stage in ("extract", "train"):
            obs["disk"] = self._disk(stage, obs, self.ws.for_run(row.run_id))
        final = row.has_ended
        if final:
            self.finished[stage] = row.id
            obs["done_when"] = evidence(self.ws.for_run(row.run_id), stage)  # what "done" means for it, and what was found
        verdict = self._diagnoser(stage, row).feed(obs)
        with self.store.atomic():
            self.store.add_observation(obs, run_id=row.run_id)
            previous = self.store.verdict(stage)
            record = StoredVerdict.of(verdict, proc_id=row.id, run=row.run_id, final=final)
            self.store.put_verdict(stage, record)
            self._condition_events(stage, row, obs, eta_s=verdict.eta_s)
            if not previous or previous.verdict != verdict.verdict or previous.proc_id != row.id:
                self.store.add_event(kind="verdict", run_id=row.run_id, stage=stage, data={
                    "from": previous.verdict if previous else None, "to": verdict.verdict,
                    "reasons": list(verdict.reasons), "progress_pct": record.progress_pct})
        return obs, verdict

    def _condition_events(self, stage: str, row: StageProc, obs: dict, *, eta_s: float | None = None) -> None:
        """An event the first time the run will not fit on disk, training reports an error (NaN, exploding), or a
        Slurm job has a tenth of its time limit left and needs longer than that (once per allocation)."""
        disk, prog = obs.get("disk") or {}, obs.get("progress") or {}
        conditions = {
            f"time-limit-{row.job_restarts or 0}": time_limit_warning(row, eta_s, now=obs["t"],
                                                                     requeue=bool(requeues(self.ws, row))),
            "disk": disk.get("fits") is False and (
                f"the run will not fit on disk: {fmt_bytes(disk['need_bytes'])} still to write, "
                f"{fmt_bytes(disk['free_bytes'])} free"
                + ("; training's kept checkpoints (--keep-last, the best by validation) and its draft: lower "
                   "--keep-last or free space" if stage == "train" else "")),
            "train-error": stage == "train" and prog.get("error") and f"training reported: {prog['error']}",
        }
        for name, reason in conditions.items():
            key = KV.condition(name, row.id)
            if reason and not self.store.get(key):
                self.store.put(key, True)
                self.store.add_event(kind="condition-alert", run_id=row.run_id, stage=stage, data={"reason": reason})

    def _disk(self, stage: str, obs: dict, ws: Workspace) -> dict | None:
        """Free space on the stage's output volume against what it will still write: the extraction's hidden
        states for the tokens left; training's checkpoints to come (kept by --keep-last) and its draft, as the
        trainer measured them at its last save."""
        prog = obs.get("progress") or {}
        if stage == "train":
            need = prog.get("disk_need_bytes") if isinstance(prog.get("disk_need_bytes"), int) else None
        else:
            left = None
            if prog.get("tokens_total") is not None and prog.get("tokens_done") is not None:
                left = prog["tokens_total"] - prog["tokens_done"]
            need = projected_need(tokens_left=left, layers=prog.get("layers"), hidden=prog.get("hidden_size"))
        out = ws.out_dir(stage)
        reading = read_disk(str(out) if out else None, need_bytes=need, clock=self.clock)
        if reading.unknown:
            obs.setdefault("unknown", {})["disk"] = reading.unknown
        return reading.value

    def _diagnoser(self, stage: str, row: StageProc) -> Diagnoser:
        current = self.diagnosers.get(stage)
        if current and current[0] == row.id:
            return current[1]
        d = Diagnoser(stage=stage, policy=self.policy)
        since = max(row.started_at or 0, self.clock() - HISTORY_S)
        for past in self.store.observations(stage=stage, since=since):
            d.feed(past)  # resume the fold after a restart of the service
        self.diagnosers[stage] = (row.id, d)
        return d

    def _maybe_thin(self) -> None:
        now = self.clock()
        if now - self.last_thin > 3600:
            self.store.thin_observations(now=now)
            self.last_thin = now


def time_limit_warning(row: StageProc, eta_s: float | None, *, now: float, requeue: bool) -> str | None:
    """"train has 5m of its 1h time limit left and needs about 25m more: …" where a running Slurm job has a tenth
    of its limit or less left and its ETA is past the limit; None otherwise."""
    if row.state != StageState.RUNNING or not row.job_limit_s or not row.job_end_at or eta_s is None:
        return None
    left = row.job_end_at - now
    if left > 0.1 * row.job_limit_s or eta_s <= left:
        return None
    then = ("Slurm's warning will stop it with a checkpoint and the job is requeued, resuming from it" if requeue else
            f"it will be killed at the limit: extend it (`scontrol update JobId={row.job_id} TimeLimit=…`)")
    return (f"{row.stage} has {fmt_s(max(left, 0.0))} of {limit_text(row.job_limit_s)} left (Slurm job {row.job_id}) "
            f"and needs about {fmt_s(eta_s)} more: {then}")


def _node_files(process: dict | None, host: str | None) -> dict | None:
    """The output directory's files as the job's batch host read them (a directory the controller cannot read)."""
    nodes = ((process or {}).get("remote") or {}).get("nodes") or {}
    node = nodes.get(host) if host else None
    return node.get("files") if isinstance(node, dict) and isinstance(node.get("files"), dict) else None


def _remote_parts(reading: Reading | None) -> tuple[list | None, str | None]:
    """A Slurm job's GPUs as its nodes read them (taken out of its process section), or why they are unknown."""
    value = reading.value if reading else None
    if not isinstance(value, dict) or "remote_gpus" not in value:
        return None, reading.unknown if reading else None
    gpus = value.pop("remote_gpus")
    nodes = value.pop("remote_nodes", {})
    why = "; ".join(f"{n}: {u['gpus']}" for n, u in nodes.items() if (u.get("unknown") or {}).get("gpus"))
    return (gpus or None), (why or None)


def _value(reading: Reading | None):
    return reading.value if reading else None
