"""The dataset JSONL: one sample a line with `input_ids`, an optional `id` and an optional `loss_mask`.

`loss_mask` (0/1 per token, as long as `input_ids`; 1 = train on this token, e.g. the
assistant's tokens from the chat template) travels into the sample file and the trainer.

One pass computes the file's hash, each line's offset and token count, without
keeping the token ids in memory (87.8 M of them would be gigabytes as Python ints).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator
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
    keys: LineKeys  # each line's content key (`line_key`)

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def tokens_total(self) -> int:
        return sum(self.tokens)

    def read(self, fh, idx: int) -> tuple[list[int], str | None]:
        """(input_ids, id) of line `idx` from an open binary handle."""
        return self.read_sample(fh, idx)[:2]

    def read_sample(self, fh, idx: int) -> tuple[list[int], str | None, list[int] | None]:
        """(input_ids, id, loss_mask or None) of line `idx`."""
        fh.seek(self.offsets[idx])
        return parse_sample(fh.readline())


KEY_BYTES = 16


def line_key(raw: bytes) -> bytes:
    """A line's content key: BLAKE2b-128 of its bytes without the line end. The extraction and the regeneration
    record it with each sample, so a sample stays this data's only while its line reads the same."""
    return hashlib.blake2b(raw.rstrip(b"\r\n"), digest_size=KEY_BYTES).digest()


class LineKeys:
    """Every line's key in one buffer (16 bytes a line, not a Python object each), read as hex strings."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def append(self, key: bytes) -> None:
        self.buf += key

    def __len__(self) -> int:
        return len(self.buf) // KEY_BYTES

    def __getitem__(self, idx: int) -> str:
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self.buf[idx * KEY_BYTES:(idx + 1) * KEY_BYTES].hex()

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


def parse_line(raw: bytes) -> tuple[list[int], str | None]:
    """Validate one data line; (input_ids, id); raises ValueError with the reason."""
    return parse_sample(raw)[:2]


def parse_sample(raw: bytes) -> tuple[list[int], str | None, list[int] | None]:
    """Validate one data line; (input_ids, id, loss_mask or None); raises ValueError with the reason."""
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
    mask = obj.get("loss_mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise ValueError(f"loss_mask must be a list as long as input_ids ({len(ids)} tokens)"
                             + (f", it has {len(mask)}" if isinstance(mask, list) else ""))
        if any(m not in (0, 1) or isinstance(m, float) for m in mask):
            raise ValueError("loss_mask must hold only 0 and 1 (1 = train on this token)")
    return ids, None if sid is None else str(sid), mask


def scan(path: Path) -> Dataset:
    """Read the whole file once: hash, offsets, token counts, malformed lines, line keys."""
    digest, offsets, tokens, errors, keys = hashlib.sha256(), array("q"), array("q"), {}, LineKeys()
    pos = 0
    with open(path, "rb") as fh:
        for idx, raw in enumerate(fh):
            digest.update(raw)
            keys.append(line_key(raw))
            offsets.append(pos)
            pos += len(raw)
            try:
                ids, _ = parse_line(raw)
                tokens.append(len(ids))
            except ValueError as exc:
                tokens.append(0)
                errors[idx] = f"data line {idx + 1}: {exc}"
    return Dataset(Path(path), digest.hexdigest(), offsets, tokens, errors, keys)
