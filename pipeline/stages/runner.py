"""The small detached runner that owns one stage process (`python -m pipeline.stages.runner`, which the
supervisor starts; `eagle3 run-stage` is the same).

It starts the stage in a new session (so its process group can be signalled as a
whole), copies its output into the rotating stage log, forwards SIGTERM to the
group, and records the exit status in the store. It lives in a session of its own,
apart from the stage's, so a SIGKILL to the stage's group leaves it alive to record
what happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from pipeline.config import STAGE_NAMES, Workspace, find_config, load_workspace
from pipeline.stages.host import RealHost, stage_env
from pipeline.stages.logfile import RotatingLog
from pipeline.stages.supervisor import claim_row, record_exit
from pipeline.states import StageState, transition
from pipeline.store import Store

DRAIN_AFTER_EXIT_S = 5.0


def _copy_output(src, log: RotatingLog) -> None:
    for chunk in iter(lambda: os.read(src.fileno(), 65536), b""):
        log.write(chunk)


def run_stage(*, ws: Workspace, stage: str, proc_id: int) -> int:
    """Run one stage process to its end; returns the runner's own exit status."""
    store = Store(ws.store_path)
    host = RealHost()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    row = store.proc(proc_id)  # its log as recorded at the start (`{run}` in a log path: the run's own)
    log = RotatingLog(Path(row.log) if row and row.log else ws.log_path(stage), max_bytes=ws.config.state.log_max_bytes, keep=ws.config.state.log_keep)
    proc = claim_row(store, proc_id, runner_pid=os.getpid(), runner_create_time=host.create_time(os.getpid()))
    if proc is None:
        log.write(f"eagle3: not starting {stage}: its start record {proc_id} was already closed or taken\n".encode())
        log.close()
        return 0
    ws = ws.for_run(proc.run_id)
    cfg = ws.stage(stage)
    argv = json.loads(proc.argv or "[]")  # recorded with the row by `start` (an empty one cannot start: said below)
    try:
        child = subprocess.Popen(
            argv, cwd=str(ws.resolve(cfg.cwd) or ws.root), env=stage_env(ws, stage, run=proc.run_id),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
    except OSError as exc:
        program = argv[0] if argv else "?"
        why = f"cannot start {program!r}: {exc.strerror or exc}"
        if "/" not in program:
            why += " (not on PATH: give stages." + stage + ".argv[0] as an absolute path; `eagle3 check-config`)"
        log.write(f"eagle3: {why}\n".encode())
        transition(store, proc, StageState.EXITED, ended_at=host.clock(), exit_code=127, reason=why)
        return 1

    def forward(signum, _frame):
        host.kill(child.pid, signum, group=True)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    store.update_proc(proc_id, pid=child.pid, pgid=child.pid, create_time=host.create_time(child.pid))
    store.add_event(kind="stage-started", run_id=proc.run_id, stage=stage, data={"pid": child.pid})
    copier = threading.Thread(target=_copy_output, args=(child.stdout, log), daemon=True)
    copier.start()
    returncode = child.wait()
    copier.join(DRAIN_AFTER_EXIT_S)  # a surviving grandchild may hold the pipe open
    record_exit(store, proc_id, returncode=returncode, now=host.clock())
    log.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.stages.runner --config FILE --stage STAGE --proc-id N`."""
    import argparse


    p = argparse.ArgumentParser(prog="python -m pipeline.stages.runner", description="the detached runner of one stage")
    p.add_argument("--config", required=True)
    p.add_argument("--stage", required=True, choices=STAGE_NAMES)
    p.add_argument("--proc-id", required=True, type=int)
    args = p.parse_args(argv)
    return run_stage(ws=load_workspace(find_config(args.config)), stage=args.stage, proc_id=args.proc_id)


if __name__ == "__main__":
    import sys

    sys.exit(main())
