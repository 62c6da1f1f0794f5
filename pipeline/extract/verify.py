"""`eagle3 verify OUT`: open random sample files and check keys, shapes, token ids, finiteness."""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.extract.dataset import scan
from pipeline.extract.writer import non_finite, read_sample
from pipeline.layout import sample_path
from pipeline.manifest import MANIFEST_NAME, read_done


@dataclass
class VerifyResult:
    """How many files were checked and what was wrong."""

    checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(out: Path, *, sample: int = 200, seed: int | None = None) -> VerifyResult:
    """Check up to `sample` random done files against the manifest meta and the data (read without torch)."""
    res = VerifyResult()
    path = Path(out) / MANIFEST_NAME
    if not path.exists():
        res.problems.append(f"{path}: no manifest")
        return res
    try:
        meta, done = read_done(Path(out))
    except sqlite3.Error as exc:
        res.problems.append(f"{path}: unreadable ({exc})")
        return res
    layers, hidden = int(meta.get("layers", 0)), int(meta.get("hidden_size", 0) or 0)
    chosen = sorted(random.Random(seed).sample(done, min(sample, len(done))))
    data = _data(meta.get("data_path"))
    want = {"token_ids", "hidden_states"} | ({"target_topk_ids", "target_topk_logprobs"}
                                             if meta.get("final_layer") == "absent" else set())
    for idx in chosen:
        f = sample_path(Path(out), idx)
        try:
            tensors = read_sample(f)
        except (OSError, ValueError) as exc:  # any unreadable file is a finding, not a crash
            res.problems.append(f"{f.name}: unreadable ({type(exc).__name__}: {exc})")
            continue
        if not want <= tensors.keys():
            res.problems.append(f"{f.name}: missing tensors {sorted(want - tensors.keys())}")
            continue
        res.checked += 1
        ids, hs = tensors["token_ids"].array, tensors["hidden_states"]
        shape, seq = hs.shape, (len(ids) if ids.ndim == 1 else "?")
        if len(shape) != 3 or shape[0] != seq or shape[1] != layers or (hidden and shape[2] != hidden):
            res.problems.append(f"{f.name}: hidden_states {shape}, expected ({seq}, {layers}, {hidden})")
        elif non_finite(hs):
            res.problems.append(f"{f.name}: non-finite values")
        if data and ids.tolist() != data(idx):
            res.problems.append(f"{f.name}: token_ids differ from data line {idx + 1}")
    return res


def _data(data_path: str | None):
    if not data_path or not Path(data_path).is_file():
        return None
    dataset = scan(Path(data_path))
    fh = open(data_path, "rb")  # noqa: SIM115 - read lazily for the chosen lines

    def read(idx: int) -> list[int] | None:
        try:
            return dataset.read(fh, idx)[0]
        except (ValueError, IndexError):
            return None

    return read


def describe(res: VerifyResult, out: Path) -> str:
    """One summary line (problems listed after it by the CLI)."""
    state = "ok" if res.ok else f"{len(res.problems)} problem(s)"
    return f"{out}: verified {res.checked} file(s): {state}"



