"""Incremental scanner of an output tree: final files as progress, all bytes as activity.

Per directory it keeps (mtime_ns, final count, final bytes, known names) and
rescans only directories whose mtime changed. A directory modified within the
filesystem's timestamp granularity of the scan may change again without its
mtime moving (the same-tick race), so such a directory is rescanned next time
too. A scan that runs out of its time budget reports unknown, never a partial
count: under heavy I/O `ls` of 3.5 TB timed out in the incident.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from pipeline.observe.probes import Reading, known, unknown

TEMP_SUFFIXES = (".tmp", ".partial", ".part")
RACE_WINDOW_NS = 2_000_000_000  # coarse filesystems stamp mtimes at 1-2 s


def is_temp(name: str) -> bool:
    """Temp names (a write in progress) are activity, never progress."""
    return name.startswith(".") or name.endswith(TEMP_SUFFIXES) or ".tmp." in name


@dataclass
class _Dir:
    mtime_ns: int = -1
    files: dict[str, int] = field(default_factory=dict)  # final name -> size
    temps: set[str] = field(default_factory=set)
    subdirs: set[str] = field(default_factory=set)
    recheck: bool = True


class BudgetExceeded(Exception):
    """The scan ran out of time."""


class FileScanner:
    """Counts final files under `root` incrementally; one instance per output tree."""

    def __init__(self, root: str, *, suffix: str = "", budget_s: float = 5.0, clock=time.monotonic,
                 wall=time.time) -> None:
        self.root = root
        self.suffix = suffix
        self.budget_s = budget_s
        self.clock = clock
        self.wall = wall
        self.dirs: dict[str, _Dir] = {}
        self.rescanned = 0  # directories listed in the last scan (for tests and benchmarks)

    def scan(self) -> Reading:
        """One tick: {count, bytes, temp_bytes, dirs} or unknown."""
        if not os.path.isdir(self.root):
            return unknown(f"{self.root}: no such directory yet", clock=self.wall)
        deadline = self.clock() + self.budget_s
        self.rescanned = 0
        try:
            seen = self._visit(self.root, deadline)
        except BudgetExceeded:
            return unknown(f"scan of {self.root} exceeded its {self.budget_s:g} s budget (filesystem under load?)",
                           clock=self.wall)
        for gone in set(self.dirs) - seen:
            del self.dirs[gone]
        count = nbytes = temp_bytes = 0
        for path, d in self.dirs.items():
            count += len(d.files)
            nbytes += sum(d.files.values())
            temp_bytes += self._temp_bytes(path, d)
        return known({"count": count, "bytes": nbytes + temp_bytes, "final_bytes": nbytes,
                      "temp_bytes": temp_bytes, "dirs": len(self.dirs)}, clock=self.wall)

    def _temp_bytes(self, path: str, d: _Dir) -> int:
        total = 0
        for name in d.temps:  # temp files grow in place: re-stat them every tick
            try:
                total += os.stat(os.path.join(path, name)).st_size
            except OSError:
                continue
        return total

    def _visit(self, root: str, deadline: float) -> set[str]:
        seen, stack = set(), [root]
        while stack:
            if self.clock() > deadline:
                raise BudgetExceeded
            path = stack.pop()
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            seen.add(path)
            d = self.dirs.setdefault(path, _Dir())
            if mtime != d.mtime_ns or d.recheck:
                self._rescan(path, d, deadline)
                d.mtime_ns = mtime
                d.recheck = time.time_ns() - mtime < RACE_WINDOW_NS
            stack.extend(os.path.join(path, s) for s in d.subdirs)
        return seen

    def _rescan(self, path: str, d: _Dir, deadline: float) -> None:
        self.rescanned += 1
        files, temps, subdirs = {}, set(), set()
        with os.scandir(path) as it:
            for i, entry in enumerate(it):
                if i % 1024 == 0 and self.clock() > deadline:
                    raise BudgetExceeded
                name = entry.name
                if entry.is_dir(follow_symlinks=False):
                    subdirs.add(name)
                elif is_temp(name):
                    temps.add(name)
                elif name.endswith(self.suffix):
                    size = d.files.get(name)  # final files never change size: stat only new ones
                    if size is None:
                        try:
                            size = entry.stat(follow_symlinks=False).st_size
                        except OSError:
                            continue
                    files[name] = size
        d.files, d.temps, d.subdirs = files, temps, subdirs
