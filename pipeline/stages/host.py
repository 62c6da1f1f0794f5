"""The one seam between supervision and the operating system.

Supervisor logic talks to a `Host`; tests substitute a fake one to drive the state
machine, and a few real-process tests prove `RealHost`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

import psutil

from pipeline.config import RUN_ENV, Workspace, without_secrets
from pipeline.train.flight import flight_env

# A process's identity is (pid, start): the kernel's start time in clock ticks since boot (/proc/<pid>/stat),
# so the same process always reads the same value and a reused pid reads a later one, at least one tick
# later. Not psutil's create_time: that is boot time plus the ticks, and the boot time the kernel reports
# moves with every step of the wall clock (NTP, a VM's clock sync), so a process read before and after a
# step looks like another process — seen here: a 9-s step made the supervisor take a live server for a
# reused pid and leave it running, holding its port. Rows recorded before hold psutil's wall-clock value
# (above BOOT_RELATIVE_BELOW) and are compared as such. The tolerance only absorbs float round-off.
CREATE_TIME_TOLERANCE_S = 0.001
BOOT_RELATIVE_BELOW = 1e9  # a recorded start below this is seconds since boot; above, a wall-clock create_time
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def port_free(port: int) -> bool:
    """True when nothing accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except OSError:
        return True


def start_time(pid: int) -> float | None:
    """A process's start as its identity records it: seconds since boot from /proc (immune to wall-clock
    steps); psutil's create_time where /proc has no stat; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2:].split()[19]) / CLOCK_TICKS
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None


def started(pid: int, like: float, *, wall: float | None = None) -> float | None:
    """A process's start in the form of the recorded value `like`: since boot, or (a row recorded before)
    psutil's wall-clock create_time (`wall`, when the caller has it)."""
    if like < BOOT_RELATIVE_BELOW:
        return start_time(pid)
    if wall is not None:
        return wall
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def stage_processes(pgid: int, since: float) -> list[tuple[psutil.Process, str, float]]:
    """(process, name, start) of every live process of a stage, created at or after `since`: those in process
    group or session `pgid` — the session because a child that calls setpgid (as some launchers' workers do)
    leaves the group but not the session — and their descendants, because others start their workers in new
    sessions (torchrun's ranks: `start_new_session=True`), out of both, while their launcher waits on them."""
    live: dict[int, tuple[psutil.Process, str, float, int]] = {}
    for proc in psutil.process_iter(["pid", "ppid", "name", "create_time", "status"]):
        info = proc.info
        start = started(info["pid"], since, wall=info["create_time"])
        if info["status"] == psutil.STATUS_ZOMBIE or start is None or start < since - CREATE_TIME_TOLERANCE_S:
            continue
        live[info["pid"]] = (proc, info["name"], start, info["ppid"])
    ours: set[int] = set()
    for pid in live:
        try:
            if os.getpgid(pid) == pgid or os.getsid(pid) == pgid:
                ours.add(pid)
        except OSError:
            continue
    grew = True
    while grew:  # descendants (each started after the stage, so never a recycled pid's)
        grew = False
        for pid, (_, _, _, ppid) in live.items():
            if pid not in ours and ppid in ours:
                ours.add(pid)
                grew = True
    return [(live[pid][0], live[pid][1], live[pid][2]) for pid in sorted(ours)]


@dataclass(frozen=True)
class Member:
    """A live process belonging to a stage's process group or session."""

    pid: int
    name: str
    create_time: float


class RealHost:
    """The operating system, through psutil and os."""

    clock = staticmethod(time.time)
    sleep = staticmethod(time.sleep)

    def identity(self, pid: int | None, create_time: float | None) -> str:
        """'alive', 'gone', 'reused' (the pid now belongs to another process) or 'unverifiable'."""
        if not pid or create_time is None:
            return "gone"
        try:
            proc = psutil.Process(pid)
            now = started(pid, create_time)
            if now is None:
                return "gone"
            if abs(now - create_time) > CREATE_TIME_TOLERANCE_S:
                return "reused"
            return "gone" if proc.status() == psutil.STATUS_ZOMBIE else "alive"
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.AccessDenied:
            return "unverifiable"

    def create_time(self, pid: int) -> float | None:
        """A process's start as its row records it (`start_time`), or None if it is gone."""
        return start_time(pid)

    def members(self, pgid: int, since: float) -> list[Member]:
        """Live processes of the stage whose group is `pgid` (`stage_processes`), created at or after `since`."""
        return [Member(p.pid, name or "?", start) for p, name, start in stage_processes(pgid, since)]

    def kill(self, pid: int, sig: int, *, group: bool) -> None:
        """Send `sig` to a process or a process group; a vanished target is not an error."""
        try:
            (os.killpg if group else os.kill)(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def spawn_detached(self, argv: list[str], *, cwd: str | None = None) -> int:
        """Start `argv` in its own session, detached from our stdio; return its pid."""
        proc = subprocess.Popen(
            argv, cwd=cwd, env=without_secrets(os.environ), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )
        # reaped when it ends: in the long-lived service a runner that exited would otherwise stay a zombie
        # (until the next spawn happened to collect it)
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()
        return proc.pid


@dataclass
class StopResult:
    """What `stop` did to one stage."""

    stage: str
    was_running: bool
    escalated: bool = False  # SIGKILL was needed
    survivors: list[Member] = field(default_factory=list)
    note: str = ""


def stage_env(ws: Workspace, stage: str, *, run: str | None = None) -> dict[str, str]:
    """The environment a stage runs with: ours without the Slack secrets, its configured env, its GPUs,
    EAGLE3_RUN (the run it belongs to: the trainer resumes only a checkpoint of the same run), and for training
    PyTorch's flight recorder, dumped under the run's forensics (pipeline/train/flight.py)."""
    cfg = ws.stage(stage)
    recorder = flight_env(ws.flight_dir(run)) if stage == "train" else {}  # what its own env sets wins
    env = without_secrets({**os.environ, **recorder, **cfg.env, "PYTHONUNBUFFERED": "1"})
    if run:
        env[RUN_ENV] = run
    if cfg.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpus)
    return env


SIGTERM = signal.SIGTERM
SIGKILL = signal.SIGKILL
