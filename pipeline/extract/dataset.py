"""The dataset JSONL: one sample a line with `input_ids` and an optional `id`.

One pass computes the file's hash, each line's offset and token count, without
keeping the token ids in memory (87.8 M of them would be gigabytes as Python ints).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Dataset:
    """Offsets and token counts of every line; lines are parsed again when sent."""

    path: Path
    sha256: str
    offsets: array  # byte offset of each line
    tokens: array  # token count of each line (0 when the line is malformed)
    errors: dict[int, str]  # line index -> reason it is malformed

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def tokens_total(self) -> int:
        return sum(self.tokens)

    def read(self, fh, idx: int) -> tuple[list[int], str | None]:
        """(input_ids, id) of line `idx` from an open binary handle."""
        fh.seek(self.offsets[idx])
        return parse_line(fh.readline())


def parse_line(raw: bytes) -> tuple[list[int], str | None]:
    """Validate one data line; raises ValueError with the reason."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected an object with input_ids")
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids missing or empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError("input_ids must be non-negative integers")
    sid = obj.get("id")
    return ids, None if sid is None else str(sid)


def scan(path: Path) -> Dataset:
    """Read the whole file once: hash, offsets, token counts, malformed lines."""
    digest, offsets, tokens, errors = hashlib.sha256(), array("q"), array("q"), {}
    pos = 0
    with open(path, "rb") as fh:
        for idx, raw in enumerate(fh):
            digest.update(raw)
            offsets.append(pos)
            pos += len(raw)
            try:
                ids, _ = parse_line(raw)
                tokens.append(len(ids))
            except ValueError as exc:
                tokens.append(0)
                errors[idx] = f"data line {idx + 1}: {exc}"
    return Dataset(Path(path), digest.hexdigest(), offsets, tokens, errors)
