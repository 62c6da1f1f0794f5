"""Diagnosis: a verdict from a stage's observation history, and nothing else.

`Diagnoser.feed` folds one observation at a time (so a 10-hour trace replays in
linear time); `diagnose(history)` is the same fold over a list. Evidence rules:
- progress comes only from the stage's own authority (manifest, step log, regex,
  file count); server counters are never progress;
- GPU idleness alone is never evidence of a stall: in the incident the GPUs sat
  idle between requests while extraction was healthy;
- a stall needs no progress past a deadline learned from the stage's own gaps
  AND no sign of work (bytes written, CPU, GPUs busy at power, a server request
  in flight) — a giant prompt or a checkpoint save shows such signs;
- requests "running" on a healthy server are work only while something else shows
  it: a wedged SGLang (a stuck collective, a wedged scheduler) keeps answering
  /health with its requests "running" while nothing completes and the GPUs idle.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from dataclasses import dataclass, field

from pipeline.observe.costfit import CostModel
from pipeline.observe.done import not_done
from pipeline.observe.eta import EtaEstimator
from pipeline.observe.latency import LatencyProfile
from pipeline.verdict import (
    Policy,
    VerdictRecord,
    fmt_s,
    gpu_busy_at_power,
    gpu_indices,
    gpu_pinned_low_power,
    num,
)

IDLE_UTIL = 5.0  # percent: below this a GPU does no work worth counting


@dataclass
class _Point:
    t: float
    processed: float | None
    tokens: float | None
    cpu_s: float | None
    written: float | None  # bytes: files incl. temp, else process write bytes


@dataclass
class Diagnoser:
    """Folds observations of one stage into verdicts."""

    stage: str
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        self.first_t: float | None = None
        self.last_processed: float | None = None
        self.last_tokens: float | None = None
        self.last_sq: float | None = None
        self.last_moments: LatencyProfile | None = None
        self.last_progress_at: float | None = None
        self.gaps: list[float] = []  # sorted, bounded
        self.stalled_since: float | None = None  # the last progress before a silence judged a stall (not a gap)
        self._gap_order: deque[float] = deque()
        self.eta = EtaEstimator()
        self.points: deque[_Point] = deque()
        self.intervals: deque[tuple[float, float, float, float | None]] = deque()  # (t, dt, dn, dk)
        self.healthy_since: float | None = None
        self.unhealthy_since: float | None = None
        self.ever_healthy = False
        # the slow check's baseline: a fit over the intervals between baseline_window_s + slow_window_s and
        # slow_window_s ago, kept as they enter and leave it (the first `_in_baseline` of `intervals` are in it)
        self._baseline = CostModel(half_life_s=math.inf)
        self._in_baseline = 0
        self.slow = False
        self.gpus_busy: tuple[float, str] | None = None  # (when, "GPUs 0–7 busy at 640 W"): the last such tick
        self.disk_wait: tuple[float, int] | None = None  # (when, how many): the last tick a member waited on the disk
        self.last_write_at: float | None = None  # the last tick whose bytes written grew
        self.gpus_read = False  # NVML answered at some tick of this stage

    # --- bookkeeping ----------------------------------------------------------
    def _note_gap(self, gap: float) -> None:
        insort(self.gaps, gap)
        self._gap_order.append(gap)
        if len(self._gap_order) > 500:
            self.gaps.remove(self._gap_order.popleft())

    @property
    def _first(self) -> float:
        """When the stage was first observed (the first observation sets it, before anything is judged)."""
        return self.first_t if self.first_t is not None else 0.0

    def deadline(self) -> float:
        """No-progress time after which a stall may be called."""
        if not self.gaps:
            return self.policy.stall_floor_s
        p99 = self.gaps[min(len(self.gaps) - 1, int(0.99 * len(self.gaps)))]
        return max(self.policy.stall_floor_s, self.policy.gap_multiplier * p99)

    def _track_progress(self, t: float, prog: dict | None) -> None:
        done, failed = num(prog, "done"), num(prog, "failed") or 0.0
        if done is None:
            return
        processed, tokens, sq = done + failed, num(prog, "tokens_done"), num(prog, "tokens_sq_done")
        moments = LatencyProfile.from_json((prog or {}).get("latency_moments"))
        if self.last_processed is None:
            self.last_processed, self.last_tokens, self.last_sq = processed, tokens, sq
            self.last_moments = moments
            self.eta.add_latency(moments)
            if processed > 0:
                self.last_progress_at = t
            return
        if processed > self.last_processed:
            # The wait before the first progress is start-up (a server loading its weights for
            # minutes), not a gap between progress: learning it would stretch the stall deadline
            # to three times the start-up, and counting it as work would inflate the ETA.
            since = self.last_progress_at
            dn = processed - self.last_processed
            dk = tokens - self.last_tokens if tokens is not None and self.last_tokens is not None else None
            dq = sq - self.last_sq if sq is not None and self.last_sq is not None else None
            # counters that went back (a manifest rebuilt) tell nothing about this interval
            dm = moments - self.last_moments if moments is not None and self.last_moments is not None else None
            if dm is not None and dm.went_back():
                dm = None
            if since is not None and t > since:
                if since != self.stalled_since:  # a silence judged a stall is no normal gap: the deadline stays
                    self._note_gap(t - since)
                self.stalled_since = None
                self.eta.add(t=t, dt=t - since, samples=dn, tokens=dk, tokens_sq=dq, latency=dm)
                self.intervals.append((t, t - since, dn, dk))
            else:
                self.eta.add_latency(dm)
            self.last_processed, self.last_tokens, self.last_sq, self.last_progress_at = processed, tokens, sq, t
            self.last_moments = moments
        horizon = t - self.policy.baseline_window_s - self.policy.slow_window_s
        while self.intervals and self.intervals[0][0] < horizon:
            _, dt, dn, dk = self.intervals.popleft()
            if self._in_baseline:
                self._baseline.remove(dt=dt, samples=dn, tokens=dk)
                self._in_baseline -= 1

    def _track_server(self, t: float, server: dict | None) -> None:
        healthy = server.get("healthy") if isinstance(server, dict) else None
        if healthy is True:
            self.ever_healthy = True
            self.unhealthy_since = None
            self.healthy_since = self.healthy_since or t
        elif healthy is False:
            self.healthy_since = None
            self.unhealthy_since = self.unhealthy_since or t

    # --- evidence ------------------------------------------------------------
    def _window(self, seconds: float, t: float) -> tuple[_Point, _Point] | None:
        if len(self.points) < 2:
            return None
        last = self.points[-1]
        first = next((p for p in self.points if p.t >= t - seconds), self.points[0])
        if first is last:
            first = self.points[-2]
        return first, last

    def _activity(self, obs: dict, t: float) -> list[str]:
        """Signs that the stage is working although no progress was counted."""
        signs = []
        # Work since the last progress only: bytes written just before a hang are not work after it; and
        # recent work only: no older than the deadline, or a write seen a tick after the last sample (a scan
        # that lagged, a last flush) would hold a hang off for the whole activity window.
        since = self.last_progress_at if self.last_progress_at is not None else self._first
        win = self._window(min(self.policy.activity_window_s, self.deadline(), max(t - since, 0.0)), t)
        if win:
            a, b = win
            if a.written is not None and b.written is not None and b.written > a.written:
                signs.append(f"{(b.written - a.written) / 1e6:.1f} MB written in the last {fmt_s(b.t - a.t)}")
            cpu = self._cpu_share(a, b)
            tick = self._cpu_share(self.points[-2], b) if self.points[-2].t >= since else None
            if cpu is not None and cpu >= self.policy.cpu_busy_share:
                signs.append(f"CPU busy ({cpu * 100:.0f} % of a core)")
            elif tick is not None and tick >= self.policy.cpu_busy_share:  # a burst the window's mean dilutes
                signs.append(f"CPU busy in the last {fmt_s(b.t - self.points[-2].t)} ({tick * 100:.0f} % of a core)")
        waiting = self._disk_waiting(t, since)
        if waiting and waiting[2] and waiting[1] <= self.policy.disk_wait_s:
            quiet = f", nothing written for {fmt_s(waiting[1])}" if waiting[1] > 0 else ""
            signs.append(f"{waiting[0]} process(es) waiting on the disk (uninterruptible sleep after writing: an "
                         f"fsync, a flush){quiet}")
        if self.gpus_busy and self.gpus_busy[0] == t:
            signs.append(self.gpus_busy[1])
        elif self.gpus_busy and self.gpus_busy[0] >= since and t - self.gpus_busy[0] <= self.policy.recent_activity_s:
            signs.append(f"{self.gpus_busy[1]} {fmt_s(t - self.gpus_busy[0])} ago")
        running = self._running_requests(obs)
        if running and (signs or not self._gpus_idle(obs)):
            signs.append(f"server healthy with {running} request(s) running")
        return signs

    def _disk_waiting(self, t: float, since: float) -> tuple[int, float, bool] | None:
        """(processes, seconds with nothing written, whether it wrote since the last progress) where a member
        of the stage was in uninterruptible sleep within the last recent_activity_s since the last progress.
        Only after a write is that a flush (an fsync of a checkpoint just written); without one it may as well
        be a process stuck in a driver (a GPU fallen off the bus leaves its processes in that state)."""
        if not self.disk_wait or self.disk_wait[0] < since or t - self.disk_wait[0] > self.policy.recent_activity_s:
            return None
        last_write = self.last_write_at
        wrote = last_write is not None and last_write > since
        return self.disk_wait[1], t - (last_write if last_write is not None and wrote else since), wrote

    @staticmethod
    def _cpu_share(a: _Point, b: _Point) -> float | None:
        if a.cpu_s is None or b.cpu_s is None or b.t <= a.t:
            return None
        return (b.cpu_s - a.cpu_s) / (b.t - a.t)

    def _track_gpus(self, t: float, obs: dict) -> None:
        self.gpus_read = self.gpus_read or bool(obs.get("gpus"))
        busy = [g for g in obs.get("gpus") or [] if isinstance(g, dict) and gpu_busy_at_power(g)]
        if busy:
            self.gpus_busy = (t, f"GPUs {gpu_indices(busy)} busy at {max(num(g, 'power_w') or 0 for g in busy):.0f} W")

    @staticmethod
    def _running_requests(obs: dict) -> int:
        server = obs.get("server") or {}
        return int(num(server, "running_reqs") or 0) if server.get("healthy") is True else 0

    @staticmethod
    def _gpus_idle(obs: dict) -> bool:
        """Every GPU read, and none doing work: only then is 'running' known to be idle."""
        gpus = [g for g in obs.get("gpus") or [] if isinstance(g, dict)]
        utils = [num(g, "util") for g in gpus]
        return bool(gpus) and all(u is not None and u < IDLE_UTIL for u in utils) and not any(
            gpu_busy_at_power(g) for g in gpus)

    def _stall_evidence(self, obs: dict, t: float) -> list[str]:
        ev = []
        since = self.last_progress_at or self._first
        a = next((p for p in self.points if p.t >= since), None)
        b = self.points[-1] if self.points else None
        if a and b and b.t > a.t:
            if a.cpu_s is not None and b.cpu_s is not None:
                ev.append(f"CPU time flat ({b.cpu_s - a.cpu_s:.1f} s in {fmt_s(b.t - a.t)})")
            if a.written is not None and b.written is not None and b.written <= a.written:
                ev.append(f"nothing written for {fmt_s(b.t - a.t)}")
        if self.unhealthy_since is not None:
            ev.append(f"server health failing for {fmt_s(t - self.unhealthy_since)}")
        waiting = self._disk_waiting(t, since)
        if waiting and waiting[2] and waiting[1] > self.policy.disk_wait_s:
            ev.append(f"{waiting[0]} process(es) waiting on the disk with nothing written for {fmt_s(waiting[1])}, "
                      f"past the {fmt_s(self.policy.disk_wait_s)} a flush may take: a hung filesystem?")
        elif waiting and not waiting[2]:
            ev.append(f"{waiting[0]} process(es) in uninterruptible sleep with nothing written since the last "
                      f"progress: a hung filesystem, or a driver (a GPU fallen off the bus)?")
        lost = (obs.get("unknown") or {}).get("gpus")
        if lost and self.gpus_read:
            ev.append(f"the GPUs were read earlier and cannot be now ({lost}): a GPU fallen off the bus, a driver fault?")
        hung = [g for g in obs.get("gpus") or [] if isinstance(g, dict) and gpu_pinned_low_power(g)]
        if hung:
            ev.append(f"GPUs {gpu_indices(hung)} pinned at 100 % at low power: a collective hang?")
        process = obs.get("process") or {}
        if process.get("zombie"):
            ev.append("the process is a zombie")
        ev += _where_read(process)
        running = self._running_requests(obs)
        if running and self._gpus_idle(obs) and a and b:
            ev.append(f"{running} request(s) 'running' on a healthy server but none completed for {fmt_s(b.t - a.t)} "
                      "and the GPUs idle: a wedged server (a stuck collective or scheduler)?")
        return ev

    # --- the fold ------------------------------------------------------------
    def feed(self, obs: dict) -> VerdictRecord:
        """Consume one observation of this stage; return the verdict at its time."""
        t = float(obs["t"])
        self.first_t = t if self.first_t is None else self.first_t
        process, prog = obs.get("process") or {}, obs.get("progress")
        files = obs.get("files") or {}
        written = num(files, "bytes")
        if written is None:
            written = num(process, "io_write_bytes")
        if written is not None and self.points and self.points[-1].written is not None \
                and written > self.points[-1].written:
            self.last_write_at = t
        waiting = num(process, "disk_wait")
        if waiting:
            self.disk_wait = (t, int(waiting))
        self.points.append(_Point(t, None, None, num(process, "cpu_s"), written))
        while self.points and self.points[0].t < t - max(self.policy.slow_window_s, self.policy.activity_window_s) - 60:
            self.points.popleft()
        self._track_progress(t, prog)
        self._track_server(t, obs.get("server"))
        self._track_gpus(t, obs)
        return self._judge(obs, t, process, prog if isinstance(prog, dict) else {})

    def _base(self, t: float, prog: dict, **kw) -> VerdictRecord:
        done, failed, total = num(prog, "done"), num(prog, "failed") or 0.0, num(prog, "total")
        pct = 100.0 * (done + failed) / total if done is not None and total else None
        rs, rt = self._rates(t)
        return VerdictRecord(t=t, stage=self.stage, progress_pct=pct, done=None if done is None else int(done),
                       failed=int(failed), total=None if total is None else int(total), rate_samples_per_s=rs,
                       rate_tokens_per_s=rt, last_progress_at=self.last_progress_at, deadline_s=self.deadline(), **kw)

    def _rates(self, t: float) -> tuple[float | None, float | None]:
        recent = [iv for iv in self.intervals if iv[0] >= t - self.policy.slow_window_s]
        span = sum(iv[1] for iv in recent)
        if not recent or span <= 0:
            return None, None
        toks = [iv[3] for iv in recent if iv[3] is not None]
        return sum(iv[2] for iv in recent) / span, (sum(toks) / span if len(toks) == len(recent) else None)

    def _judge(self, obs: dict, t: float, process: dict, prog: dict) -> VerdictRecord:
        ended = process.get("alive") is False or process.get("exit_code") is not None
        if ended:
            return self._ended(t, process, prog, obs.get("done_when"))
        if process.get("queued"):  # waiting for Slurm's allocation: the startup window begins when it runs
            self.first_t = t
            self.last_progress_at = None  # requeued: the wait and the start again are no gap between progress
            return self._base(t, prog, verdict="starting", reasons=(
                f"{process.get('queue_reason') or 'queued in Slurm'} — waiting for its allocation, not a stall",))
        if process.get("alive") is None and not prog and not obs.get("server"):
            why = (obs.get("unknown") or {}).get("process", "no process reading")
            return self._base(t, prog, verdict="unknown", reasons=(f"process state unknown: {why}",))
        if num(prog, "done") is None:
            return self._judge_without_progress(obs, t, prog)
        return self._judge_progress(obs, t, prog)

    def _ended(self, t: float, process: dict, prog: dict, rule: dict | None = None) -> VerdictRecord:
        code = process.get("exit_code")
        if process.get("stop_requested"):
            how = "" if code is None else (f" (signal {-code})" if code < 0 else f" (exit {code})")
            return self._base(t, prog, verdict="stopped", reasons=(f"stopped on request{how}",))
        if process.get("interrupted"):  # a Slurm job's time limit, preemption or node: it is submitted again
            return self._base(t, prog, verdict="stopped", reasons=(
                f"{process['interrupted']}: Slurm's job ended, not the stage; it is submitted again and resumes",))
        if code is None:
            return self._base(t, prog, verdict="dead", reasons=("the process vanished; exit status unknown",))
        if code != 0:
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            if process.get("last_line"):
                how += f"; its log says: {process['last_line']}"
            return self._base(t, prog, verdict="dead", reasons=(how,))
        why = not_done(rule, prog)  # the stage's done_when beyond exit 0 (another tool's exit 0 is its opinion)
        if why:
            return self._base(t, prog, verdict="dead", reasons=(why,))
        done, failed, total = num(prog, "done"), num(prog, "failed") or 0.0, num(prog, "total")
        if done is None or not total:
            return self._base(t, prog, verdict="done", reasons=("exited 0",), eta_s=0.0)
        if done + failed < total:
            pct = 100.0 * (done + failed) / total
            return self._base(t, prog, verdict="dead",
                              reasons=(f"exited early at {pct:.1f} % ({int(done + failed):,} / {int(total):,})",))
        share = failed / total
        if share > self.policy.max_failed_share:
            return self._base(t, prog, verdict="dead", reasons=(
                f"{share * 100:.2g} % of samples failed, above the {self.policy.max_failed_share * 100:.2g} % maximum",))
        return self._base(t, prog, verdict="done", reasons=(f"exited 0 with {int(done):,} / {int(total):,} done",),
                          eta_s=0.0, eta_low_s=0.0, eta_high_s=0.0)

    def _judge_without_progress(self, obs: dict, t: float, prog: dict) -> VerdictRecord:
        server = obs.get("server")
        if isinstance(server, dict) and server.get("healthy") is not None:
            if server["healthy"]:
                return self._base(t, prog, verdict="progressing", reasons=("serving; health check passing",))
            down = t - (self.unhealthy_since or t)
            if not self.ever_healthy and t - self._first < self.policy.startup_window_s:
                return self._base(t, prog, verdict="starting", reasons=("waiting for the health check to pass",))
            if down >= self.policy.stall_floor_s:
                return self._base(t, prog, verdict="stalled", reasons=(f"health check failing for {fmt_s(down)}",))
            return self._base(t, prog, verdict="slow", reasons=(f"health check failing for {fmt_s(down)}",))
        if t - self._first < self.policy.startup_window_s:
            return self._base(t, prog, verdict="starting", reasons=("no progress reading yet",))
        return self._judge_stall(obs, t, prog, since=self._first, what="no progress reading yet")

    def _judge_progress(self, obs: dict, t: float, prog: dict) -> VerdictRecord:
        if self.last_progress_at is None and t - self._first < self.policy.startup_window_s:
            return self._base(t, prog, verdict="starting", reasons=("no sample finished yet",))
        since = self.last_progress_at if self.last_progress_at is not None else self._first
        gap = t - since
        if gap > self.deadline():
            return self._judge_stall(obs, t, prog, since=since, what=f"no progress for {fmt_s(gap)}")
        eta = self._eta(prog)
        slow = self._slow_reason(t)
        return self._base(t, prog, verdict="slow" if slow else "progressing",
                          reasons=tuple(r for r in (slow, f"last progress {fmt_s(gap)} ago") if r), **eta)

    def _judge_stall(self, obs: dict, t: float, prog: dict, *, since: float, what: str) -> VerdictRecord:
        gap = t - since
        deadline = f"deadline {fmt_s(self.deadline())} learned from this stage's gaps"
        activity = self._activity(obs, t)
        if activity and gap < self.policy.ceiling_s:
            return self._base(t, prog, verdict="progressing",
                              reasons=(f"{what}, but it is working: " + "; ".join(activity),), **self._eta(prog))
        evidence = self._stall_evidence(obs, t) or ["no sign of work (CPU, disk, GPU and server readings unknown)"]
        if activity:
            evidence.append(f"still busy after {fmt_s(gap)}, past the {fmt_s(self.policy.ceiling_s)} ceiling")
        self.stalled_since = since
        return self._base(t, prog, verdict="stalled", reasons=(f"{what} ({deadline})", *evidence))

    def _eta(self, prog: dict) -> dict:
        done, failed, total = num(prog, "done"), num(prog, "failed") or 0.0, num(prog, "total")
        if done is None or not total:
            return {}
        tok_total, tok_done = num(prog, "tokens_total"), num(prog, "tokens_done")
        tokens_left = tok_total - tok_done if tok_total is not None and tok_done is not None else None
        sq_total, sq_done = num(prog, "tokens_sq_total"), num(prog, "tokens_sq_done")
        sq_left = sq_total - sq_done if sq_total is not None and sq_done is not None else None
        est = self.eta.estimate(samples_left=total - done - failed, tokens_left=tokens_left, tokens_sq_left=sq_left,
                                done_share=(done + failed) / total)
        if est is None:
            return {"eta_note": self.eta.why} if self.eta.why else {}
        return {"eta_s": est.eta_s, "eta_low_s": est.low_s, "eta_high_s": est.high_s}

    def _slow_reason(self, t: float) -> str | None:
        p = self.policy
        if self.first_t is None or t - self.first_t < p.slow_window_s + p.baseline_window_s / 3:
            return None
        model = self._baseline
        while self._in_baseline < len(self.intervals) and self.intervals[self._in_baseline][0] < t - p.slow_window_s:
            end, dt, dn, dk = self.intervals[self._in_baseline]
            model.add(t=end, dt=dt, samples=dn, tokens=dk)
            self._in_baseline += 1
        if model.sums.count < 10:  # too few intervals for a baseline (the count is whole: rows enter and leave as ±1)
            return None
        recent = [iv for iv in self.intervals if iv[0] >= t - p.slow_window_s]
        if len(recent) < 3:
            return None
        toks = [iv[3] for iv in recent if iv[3] is not None]
        predicted = model.predict(samples=sum(iv[2] for iv in recent),
                                  tokens=sum(toks) if len(toks) == len(recent) else None)
        actual = sum(iv[1] for iv in recent)
        if not predicted:
            return None
        ratio = actual / predicted
        # Hysteresis: enter above slow_ratio, leave only once clearly back to normal,
        # so a run hovering at the threshold does not flap between verdicts.
        self.slow = ratio > (p.slow_ratio / 1.5 if self.slow else p.slow_ratio)
        if self.slow:
            return f"recent work took {ratio:.1f}× as long as this stage's own earlier rate predicts"
        return None


def diagnose(history: list[dict], *, stage: str | None = None, policy: Policy | None = None) -> VerdictRecord | None:
    """The verdict after the last observation of `history` (one stage), or None if empty."""
    if not history:
        return None
    d = Diagnoser(stage=stage or history[0].get("stage", "?"), policy=policy or Policy())
    verdict = None
    for obs in history:
        verdict = d.feed(obs)
    return verdict


def _where_read(process: dict) -> list[str]:
    """Stopped members (SIGSTOP, a debugger: they take no CPU and write nothing), node by node for a Slurm job,
    and where and how long ago a remote job's processes were read."""
    remote = process.get("remote") if isinstance(process.get("remote"), dict) else None
    nodes = (remote or {}).get("nodes") or {}
    out = []
    if nodes:
        out += [f"on {node}: {n.get('stopped')} of {n.get('members')} process(es) stopped (state T: SIGSTOP, a debugger)"
                for node, n in nodes.items() if n.get("stopped")]
    elif process.get("stopped"):
        out.append(f"{process['stopped']} process(es) stopped (state T: SIGSTOP, a debugger)")
    if remote:
        out.append(f"processes read through {remote.get('via')}, {fmt_s(remote.get('age_s') or 0)} ago")
    return out
