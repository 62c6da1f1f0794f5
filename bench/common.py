"""Shared benchmark helpers: machine description, timing, the RESULTS.md writer."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    """CPU model, cores, memory and OS, for the results header."""
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s))) - 1))]


def timed(fn, repeat: int = 1) -> list[float]:
    """Wall seconds of each of `repeat` calls."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def write_block(name: str, lines: list[str]) -> None:
    """Replace this tool's block of RESULTS.md (between its markers), keeping the other tools' blocks."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = RESULTS.read_text() if RESULTS.exists() else ""
    block = "\n".join([begin, *lines, end])
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    RESULTS.write_text(text)
