"""Process probe: liveness, CPU time and bytes written over a stage's whole process group."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil

from pipeline.observe.probes import Reading, known, unknown
from pipeline.stages.host import stage_processes
from pipeline.stages.logfile import tail_lines
from pipeline.states import StageProc, StageState


def group_processes(pgid: int, since: float) -> list[psutil.Process]:
    """The stage's processes: its group, its session and their descendants (torchrun's ranks, in sessions of their
    own), created at or after `since` (pipeline/stages/host.stage_processes)."""
    return [p for p, _, _ in stage_processes(pgid, since)]


FAILURE_TAIL_LINES = 200
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_RULE = re.compile(r"^[=\-_*#~.\s]*$")  # a line of only rules and spaces says nothing


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def last_log_line(path: str | None) -> str | None:
    """What a failed stage's log says of its failure, in one line of at most 300 characters (None if unreadable):
    torchrun's "Root Cause (first observed failure)" (the rank, its exit code or signal, and its traceback line);
    else a Python traceback's last frame and its exception; else the last line that is not a rule of '='."""
    try:
        lines = [line.rstrip() for line in tail_lines(Path(path), FAILURE_TAIL_LINES)] if path else []
    except OSError:
        return None
    return root_cause(lines) or last_traceback(lines) or next(
        (_clip(x.strip()) for x in reversed(lines) if x.strip() and not _RULE.match(x)), None)


def root_cause(lines: list[str]) -> str | None:
    """torchrun's root cause block: "rank 3 (local_rank: 3) failed: exitcode 1 (pid: 4242): <its traceback line>"."""
    start = next((i for i in range(len(lines) - 1, -1, -1) if "Root Cause (first observed failure)" in lines[i]), None)
    if start is None:
        return None
    fields = {}
    for line in lines[start + 1:start + 12]:
        m = _ROOT_FIELD.match(line)
        if m and m.group(1) not in fields:
            fields[m.group(1)] = m.group(2).strip()
    if "rank" not in fields:
        return None
    text = f"torchrun root cause: rank {fields['rank']} failed, exitcode {fields.get('exitcode', '?')}"
    why = fields.get("traceback", "")
    if why and "To enable traceback" not in why:
        text += f": {why}"
    else:  # no error file: the rank's own traceback, where its output is in the same log ("[rank1]: …" lines)
        rank = fields["rank"].split()[0]
        prefix = f"[rank{rank}]: "
        own = [line[len(prefix):] for line in lines[:start] if line.startswith(prefix)]
        tb = last_traceback(own) if own else last_traceback(lines[:start])
        said = next((x.strip() for x in reversed(own) if x.strip() and not _RULE.match(x)), None)
        if tb and "ChildFailedError" not in tb:  # not torchrun's own traceback
            text += f"; {tb}"
        elif said:  # a one-line error of the rank's own (eagle3's trainer prints no traceback for bad input)
            text += f"; rank {rank} said: {said}"
    return _clip(text)


def last_traceback(lines: list[str]) -> str | None:
    """The last Python traceback's last frame and its exception: "ValueError: bad (loop.py:120 in step)"."""
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].lstrip().startswith("Traceback (most recent")),
                 None)
    if start is None:
        return None
    frame, message = None, None
    for line in lines[start + 1:]:
        m = _FRAME.match(line)
        if m:
            frame, message = m, None
        elif line.strip() and not line.startswith((" ", "\t")) and frame is not None:
            message = line.strip()
            break
    if message is None:
        return None
    where = f" ({Path(frame.group(1)).name}:{frame.group(2)} in {frame.group(3)})" if frame else ""
    return _clip(message + where)


def read_process(row: StageProc | None, *, clock=time.time) -> Reading:
    """The `process` section of an observation for a stage-process row."""
    if row is None:
        return unknown("stage not started", clock=clock)
    stop = bool(row.stop_requested)
    if row.has_ended:
        code = row.exit_code if row.exit_code is not None else (-row.signal if row.signal else None)
        value: dict[str, object] = {"alive": False, "exit_code": code, "stop_requested": stop}
        line = last_log_line(row.log) if code and not stop else None
        if line:
            value["last_line"] = line
        return known(value, clock=clock)
    if row.executor == "slurm":  # the cluster's word, from the row the supervisor keeps current
        queued = row.state == StageState.QUEUED
        value = {"alive": True if row.state == StageState.RUNNING else None, "exit_code": None,
                 "stop_requested": stop, "job_id": row.job_id, "queued": queued}
        if queued:
            value["queue_reason"] = row.reason
        return known(value, clock=clock)
    if row.pid is None:
        return known({"alive": None, "exit_code": None, "stop_requested": stop}, clock=clock)
    members = group_processes(row.pgid if row.pgid is not None else row.pid, row.create_time or 0)
    if not members:
        # Gone, but the runner has not recorded how yet: say so rather than guess "vanished".
        return Reading(t=clock(), value={"alive": None, "exit_code": None, "stop_requested": stop},
                       unknown="the process ended; its exit status is not recorded yet")
    leader = next((p for p in members if p.pid == row.pid), None)
    value = {"alive": leader is not None or bool(members), "exit_code": None, "stop_requested": stop,
             **totals(members, leader_pid=row.pid)}
    return known(value, clock=clock)


def totals(members: list[psutil.Process], *, leader_pid: int | None = None) -> dict:
    """What a stage's processes add up to, on this host: how many, their CPU time and bytes written, how many
    wait on the disk (uninterruptible sleep: an fsync, a flush to a network filesystem) and how many are stopped
    (SIGSTOP, a debugger), and whether the leader is a zombie. The remote probe (`eagle3 probe`) gives the same."""
    out: dict = {"members": len(members), "zombie": False}
    cpu = io = 0.0
    disk_wait = stopped = 0
    io_reason = None
    for p in members:
        try:
            with p.oneshot():
                status = p.status()
                if p.pid == leader_pid and status == psutil.STATUS_ZOMBIE:
                    out["zombie"] = True
                disk_wait += status == psutil.STATUS_DISK_SLEEP
                stopped += status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
                t = p.cpu_times()
                cpu += t.user + t.system
                try:
                    io += p.io_counters().write_bytes
                except (psutil.AccessDenied, AttributeError) as exc:
                    io_reason = f"I/O counters unavailable ({type(exc).__name__})"
        except psutil.Error:
            continue
    out["cpu_s"] = round(cpu, 3)
    out["io_write_bytes"] = None if io_reason else int(io)
    out["disk_wait"] = disk_wait
    out["stopped"] = stopped
    return out
