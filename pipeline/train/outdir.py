"""A training `--out` directory between runs: what an earlier training left there, and moving it aside.

Torch-free, so that `eagle3 start train --fresh` (the controller) and the trainer's `--fresh` share it.
An earlier training's checkpoints, progress and draft are moved to OUT/previous/<UTC time>/, so that one
`--out` never mixes two trainings' steps. What is kept there is bounded (`trim_previous`): every earlier
training keeps its exported draft, progress and validation; the newest `keep_previous` of them keep their last
and best checkpoints too (to resume or export from); no other checkpoint is kept. Checkpoints within a training are
bounded by the trainer (`prune`): the newest `--keep-last` and the best by validation.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

PREVIOUS = "previous"
# what one training writes into its --out (checkpoint.py, loop.py, export.py)
TRAINING_FILES = ("checkpoints", "latest", "progress.jsonl", "validation.jsonl", "draft")
KEEP_LAST = 3  # checkpoints a training keeps besides its best by validation (`--keep-last`)
KEEP_PREVIOUS = 2  # earlier trainings in OUT/previous/ that keep their last and best checkpoints (`--keep-previous`)
STEP_PREFIX = "step_"


def steps_saved(out: Path) -> list[int]:
    """The steps with a directory in OUT/checkpoints/, ascending."""
    found = []
    for d in (Path(out) / "checkpoints").glob(f"{STEP_PREFIX}*"):
        try:
            found.append(int(d.name.removeprefix(STEP_PREFIX)))
        except ValueError:
            continue
    return sorted(found)


def named_latest(out: Path) -> int | None:
    """The step OUT/latest names, or None."""
    try:
        return int((Path(out) / "latest").read_text().strip().removeprefix(STEP_PREFIX))
    except (OSError, ValueError):
        return None


def accepted_length(acc: list) -> float:
    """The length a draft with these top-1 rates by position would have accepted on average (Σ_k Π_{j≤k} acc_j):
    the validation figure the best checkpoint is chosen by (a step with no figure counts as 0)."""
    total, run = 0.0, 1.0
    for a in acc:
        run *= a or 0.0
        total += run
    return total


def best_validated(out: Path) -> int | None:
    """The validated step with the longest accepted length (the earliest of equals), from OUT/validation.jsonl."""
    best = None
    try:
        lines = (Path(out) / "validation.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
            score = accepted_length(rec.get("acc") or [])
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if best is None or score > best[0]:
            best = (score, step)
    return best[1] if best else None


def prune(out: Path, *, keep_last: int) -> list[int]:
    """Delete the checkpoints older than the newest `keep_last` at or before `latest`, keeping the best by
    validation and whatever `latest` names; a step past `latest` (a save cut short) is left to be written again.
    `keep_last` 0 keeps every one. Returns the steps deleted."""
    latest = named_latest(out)
    if not keep_last or latest is None:
        return []
    complete = [s for s in steps_saved(out) if s <= latest]
    keep = set(complete[-keep_last:]) | {latest, best_validated(out)}
    gone = [s for s in complete if s not in keep]
    for s in gone:
        shutil.rmtree(Path(out) / "checkpoints" / f"{STEP_PREFIX}{s}", ignore_errors=True)
    return gone


@dataclass
class CheckpointFit:
    """What the checkpoints still to come will hold on OUT's volume, measured on the one just saved."""

    checkpoint_bytes: int
    need_bytes: int  # more bytes the kept checkpoints and the exported draft will take
    free_bytes: int | None

    @property
    def problem(self) -> str | None:
        if self.free_bytes is None or self.need_bytes <= self.free_bytes:
            return None
        return (f"the checkpoints to come will not fit: each takes {_size(self.checkpoint_bytes)}, and those kept "
                f"(--keep-last and the best by validation) and the draft need {_size(self.need_bytes)} more, "
                f"{_size(self.free_bytes)} free; lower --keep-last or --save-every's frequency, or free space")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def saves_after(step: int, *, steps: int, save_every: int, eval_every: int) -> int:
    """How many checkpoints the trainer will still write after `step` (every --save-every, every validated step,
    the last)."""
    return sum(1 for s in range(step + 1, steps + 1)
               if s % save_every == 0 or s == steps or (eval_every and s % eval_every == 0))


def checkpoint_fit(out: Path, *, step: int, keep_last: int, steps: int, save_every: int,
                   eval_every: int) -> CheckpointFit:
    """Measure the checkpoint at `step` and project what the rest of the training will hold at its peak: up to
    `keep_last` + 2 checkpoints at once (the kept, the best, the one being written), and the draft."""
    d = Path(out) / "checkpoints" / f"{STEP_PREFIX}{step}"
    files = [p for p in d.iterdir() if p.is_file()] if d.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    weights = next((p.stat().st_size for p in files if p.name == "model.safetensors"), 0)
    held = len(steps_saved(out))
    left = saves_after(step, steps=steps, save_every=save_every, eval_every=eval_every)
    peak = held + left if not keep_last else min(held + left, keep_last + 2)
    draft_left = 0 if (Path(out) / "draft").exists() else weights
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = None
    return CheckpointFit(size, max(0, peak - held) * size + draft_left, free)


def trim_previous(out: Path, *, keep_previous: int = KEEP_PREVIOUS) -> list[Path]:
    """Bound OUT/previous/: each earlier training keeps its draft, progress and validation; the newest
    `keep_previous` keep the checkpoint their `latest` names and their best by validation as well, and no other.
    Returns what was deleted."""
    root = Path(out) / PREVIOUS
    if not root.is_dir():
        return []
    trainings = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name, reverse=True)
    deleted = []
    for n, d in enumerate(trainings):
        last = named_latest(d) if n < keep_previous else None
        keep = {last, best_validated(d)} if last is not None else set()
        for s in steps_saved(d):
            if s not in keep:
                path = d / "checkpoints" / f"{STEP_PREFIX}{s}"
                shutil.rmtree(path, ignore_errors=True)
                deleted.append(path)
        if last is None and (d / "latest").exists():
            (d / "latest").unlink()
    return deleted


def set_aside(out: Path, *, now: float | None = None, keep_previous: int = KEEP_PREVIOUS) -> Path | None:
    """Move an earlier training's files in `out` to OUT/previous/<UTC time>/, then bound OUT/previous/
    (`trim_previous`); returns where they went, or None when there was nothing to move."""
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
    trim_previous(out, keep_previous=keep_previous)
    return dest
