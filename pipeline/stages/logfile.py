"""Stage logs: size-capped rotation for the runner, and a cheap tail for readers."""

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
        for i in range(self.keep, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i - 1}") if i > 1 else self.path
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i}"))
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


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
