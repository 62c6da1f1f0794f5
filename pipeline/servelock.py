"""One `eagle3 serve` per workspace: two would run the handoff twice and post every message twice."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO

from pipeline.errors import UserError


class ServeLock:
    """An exclusive flock on STATE_DIR/serve.lock holding the owner's pid. The kernel drops it
    when the process dies, kill -9 included, so a stale file never blocks a restart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh: TextIO | None = None

    def __enter__(self) -> ServeLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")  # noqa: SIM115 - held for the life of the service
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise UserError(f"another `eagle3 serve` (pid {holder}) is already running on this workspace "
                            f"({self.path}); stop it first (`systemctl stop eagle3`, or kill -TERM {holder})") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self.fh = fh
        return self

    def __exit__(self, *exc) -> None:
        if self.fh:
            self.fh.close()
            self.fh = None
