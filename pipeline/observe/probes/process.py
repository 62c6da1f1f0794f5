"""Process probe: liveness, CPU time and bytes written over a stage's whole process group."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from pipeline.observe.probes import Reading, known, unknown
from pipeline.stages.host import started
from pipeline.stages.logfile import tail_lines
from pipeline.states import StageState


def group_processes(pgid: int, since: float) -> list[psutil.Process]:
    """Processes in the stage's process group or session, created at or after `since`."""
    found = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            start = started(proc.info["pid"], since, wall=proc.info["create_time"])
            if start is None or start < since - 0.001:
                continue
            pid = proc.info["pid"]
            if os.getpgid(pid) == pgid or os.getsid(pid) == pgid:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def last_log_line(path: str | None) -> str | None:
    """The last non-empty line of a stage's log (its error, usually), at most 300 characters; None if unreadable."""
    try:
        lines = [line.strip() for line in tail_lines(Path(path), 5)] if path else []
    except OSError:
        return None
    line = next((x for x in reversed(lines) if x), None)
    return line if line is None or len(line) <= 300 else line[:299] + "…"


def read_process(row: dict | None, *, clock=time.time) -> Reading:
    """The `process` section of an observation for a stage-process row."""
    if row is None:
        return unknown("stage not started", clock=clock)
    stop = bool(row.stop_requested)
    if row.has_ended:
        code = row.exit_code if row.exit_code is not None else (-row.signal if row.signal else None)
        value = {"alive": False, "exit_code": code, "stop_requested": stop}
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
    members = group_processes(row.pgid, row.create_time or 0)
    if not members:
        # Gone, but the runner has not recorded how yet: say so rather than guess "vanished".
        return Reading(t=clock(), value={"alive": None, "exit_code": None, "stop_requested": stop},
                       unknown="the process ended; its exit status is not recorded yet")
    leader = next((p for p in members if p.pid == row.pid), None)
    value = {"alive": leader is not None or bool(members), "exit_code": None, "stop_requested": stop,
             "members": len(members), "zombie": False}
    cpu = io = 0.0
    disk_wait = 0  # members in uninterruptible sleep: waiting on the disk (an fsync, a flush to a network filesystem)
    io_reason = None
    for p in members:
        try:
            with p.oneshot():
                status = p.status()
                if p.pid == row.pid and status == psutil.STATUS_ZOMBIE:
                    value["zombie"] = True
                disk_wait += status == psutil.STATUS_DISK_SLEEP
                t = p.cpu_times()
                cpu += t.user + t.system
                try:
                    io += p.io_counters().write_bytes
                except (psutil.AccessDenied, AttributeError) as exc:
                    io_reason = f"I/O counters unavailable ({type(exc).__name__})"
        except psutil.Error:
            continue
    value["cpu_s"] = round(cpu, 3)
    value["io_write_bytes"] = None if io_reason else int(io)
    value["disk_wait"] = disk_wait
    return known(value, clock=clock)
