"""Stage logs: size-capped rotation for the runner and for Slurm jobs' output, and a cheap tail for readers."""

from __future__ import annotations

import os
from pathlib import Path


class RotatingLog:
    """Append bytes to `path`, rotating to path.1 … path.K past `max_bytes`."""

    def __init__(self, path: Path, *, max_bytes: int, keep: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held for the runner's life
        self._size = self._fh.tell()

    def write(self, data: bytes) -> None:
        """Append `data`, rotating first if it would pass the cap."""
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._fh.write(data)
        self._size += len(data)

    def _rotate(self) -> None:
        self._fh.close()
        _shift(self.path, self.keep)
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


def _shift(path: Path, keep: int) -> None:
    """path.1 … path.(keep-1) move up one (the oldest is dropped), making room for a new path.1."""
    for i in range(keep, 1, -1):
        src = path.with_name(f"{path.name}.{i - 1}")
        if src.exists():
            os.replace(src, path.with_name(f"{path.name}.{i}"))


def rotate_in_place(path: Path, *, max_bytes: int, keep: int) -> bool:
    """Rotate a log another program appends to (a Slurm job's `--open-mode=append` output): copy it to
    path.1, then truncate it where it is, so the writer's next append lands at the new start. Lines
    written between the copy and the truncation are lost (a few, on a busy log). True if rotated."""
    import shutil

    try:
        if path.stat().st_size <= max_bytes:
            return False
        _shift(path, keep)
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.truncate(path, 0)
    except OSError:
        return False
    return True


def tail_lines(path: Path, n: int, *, block: int = 65536) -> list[str]:
    """The last `n` lines of a file, reading backwards from the end ([] if missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            pos, data = fh.tell(), b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(block, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:] if n > 0 else []
