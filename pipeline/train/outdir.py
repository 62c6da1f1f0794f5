"""A training `--out` directory between runs: what an earlier training left there, and moving it aside.

Torch-free, so that `eagle3 start train --fresh` (the controller) and the trainer's `--fresh` share it.
Nothing here deletes: an earlier training's checkpoints, progress and draft are moved, whole, to
OUT/previous/<UTC time>/, so that one `--out` never mixes two trainings' steps.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PREVIOUS = "previous"
# what one training writes into its --out (checkpoint.py, loop.py, export.py)
TRAINING_FILES = ("checkpoints", "latest", "progress.jsonl", "validation.jsonl", "draft")


def set_aside(out: Path, *, now: float | None = None) -> Path | None:
    """Move an earlier training's files in `out` to OUT/previous/<UTC time>/ (never deleting);
    returns where they went, or None when there was nothing to move."""
    out = Path(out)
    present = [name for name in TRAINING_FILES if (out / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    dest = out / PREVIOUS / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out / PREVIOUS / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in present:
        os.replace(out / name, dest / name)
    return dest
