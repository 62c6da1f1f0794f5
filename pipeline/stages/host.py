"""The one seam between supervision and the operating system.

Supervisor logic talks to a `Host`; tests substitute a fake one to drive the state
machine, and a few real-process tests prove `RealHost`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import psutil

from pipeline.config import RUN_ENV, Workspace, without_secrets

# create_time is boot time plus the kernel's start time in clock ticks (10 ms), so
# the same process always reads the same value; a reused pid reads a later one, at
# least one tick later. The tolerance only absorbs float round-off.
CREATE_TIME_TOLERANCE_S = 0.001


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
            if abs(proc.create_time() - create_time) > CREATE_TIME_TOLERANCE_S:
                return "reused"
            return "gone" if proc.status() == psutil.STATUS_ZOMBIE else "alive"
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.AccessDenied:
            return "unverifiable"

    def create_time(self, pid: int) -> float | None:
        """A process's create_time, or None if it is gone."""
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None

    def members(self, pgid: int, since: float) -> list[Member]:
        """Live processes in process group or session `pgid`, created at or after `since`.

        The session is included because a child that calls setpgid (as some
        launchers' workers do) leaves the group but not the session.
        """
        found = []
        for proc in psutil.process_iter(["pid", "name", "create_time", "status"]):
            info = proc.info
            if info["status"] == psutil.STATUS_ZOMBIE or (info["create_time"] or 0) < since - CREATE_TIME_TOLERANCE_S:
                continue
            try:
                if os.getpgid(info["pid"]) != pgid and os.getsid(info["pid"]) != pgid:
                    continue
            except OSError:
                continue
            found.append(Member(info["pid"], info["name"] or "?", info["create_time"]))
        return found

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
    and EAGLE3_RUN (the run it belongs to: the trainer resumes only a checkpoint of the same run)."""
    cfg = ws.stage(stage)
    env = without_secrets({**os.environ, **cfg.env, "PYTHONUNBUFFERED": "1"})
    if run:
        env[RUN_ENV] = run
    if cfg.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpus)
    return env


SIGTERM = signal.SIGTERM
SIGKILL = signal.SIGKILL
