"""Disk probe: free bytes on the output volume, projected need, I/O pressure."""

from __future__ import annotations

import os
import shutil
import time

from pipeline.observe.probes import Reading, known, unknown


def projected_need(*, tokens_left: float | None, layers: int | None, hidden: int | None,
                   bytes_per_value: int = 2) -> int | None:
    """Bytes still to be written: tokens × layers × hidden size × 2 (bf16)."""
    if tokens_left is None or not layers or not hidden:
        return None
    return int(tokens_left * layers * hidden * bytes_per_value)


def io_pressure(path: str = "/proc/pressure/io") -> float | None:
    """The 'some avg10' I/O pressure in percent, where the kernel reports it."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("some"):
                    return float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
    except (OSError, ValueError, KeyError):
        return None
    return None


def read_disk(path: str | None, *, need_bytes: int | None, clock=time.time) -> Reading:
    """{free_bytes, need_bytes, fits, io_pressure_pct} for the volume holding `path`."""
    if not path:
        return unknown("no output directory configured", clock=clock)
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe or "/").free
    except OSError as exc:
        return unknown(f"{path}: cannot read free space ({exc.strerror})", clock=clock)
    fits = None if need_bytes is None else free >= need_bytes
    return known({"free_bytes": free, "need_bytes": need_bytes, "fits": fits,
                  "io_pressure_pct": io_pressure()}, clock=clock)
