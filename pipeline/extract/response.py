"""Turning an SGLang `/generate` answer into validated per-sample tensors (pure functions).

`meta_info.hidden_states` is a list: the prefill's `[rows][D]`, then one `[D]` row per
decoded token. Take the prefill element, drop the decode rows, and only then compare
the row count with len(input_ids). Under chunked prefill SGLang keeps only the last
chunk's rows, so a long prompt comes back short — deterministically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class BadResponse(Exception):
    """The answer cannot be used; `retry` says whether asking again may help."""

    def __init__(self, reason: str, *, retry: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.retry = reason, retry


@dataclass
class Extracted:
    """One sample's data, before conversion to tensors."""

    rows: list  # [seq][D] floats
    topk_ids: list | None = None  # [seq][K]
    topk_logprobs: list | None = None


def prefill_rows(meta: dict) -> list:
    """The prefill's rows from meta_info.hidden_states (decode rows dropped)."""
    hs = meta.get("hidden_states")
    if not isinstance(hs, list) or not hs:
        raise BadResponse("meta_info.hidden_states missing or empty (is --enable-return-hidden-states set?)")
    first = hs[0]
    if isinstance(first, list) and first and isinstance(first[0], list):
        return first  # [rows][D], followed by [D] decode rows
    if isinstance(first, list) and first and isinstance(first[0], (int, float)):
        return [first]  # a single-row prefill flattened to [D]
    raise BadResponse("meta_info.hidden_states has an unexpected shape")


def check_rows(rows, *, seq: int, layers: int, width: int | None, chunk: int | None) -> int:
    """Validate the row count, width and finiteness of `rows` (lists, or fastparse's [rows, D] array);
    return D (row width)."""
    if len(rows) != seq:
        if chunk and seq > chunk and len(rows) == (seq % chunk or chunk):
            raise BadResponse(
                f"got {len(rows)} rows for {seq} tokens: chunked prefill kept only the last chunk; restart the server "
                f"with --chunked-prefill-size ≥ {seq} (now {chunk})", retry=False)
        raise BadResponse(f"got {len(rows)} hidden-state rows for {seq} input tokens")
    d = len(rows[0])
    if d % layers:
        raise BadResponse(f"row width {d} is not a multiple of {layers} layers", retry=False)
    if width is not None and d != width:
        raise BadResponse(f"row width {d} differs from the run's {width} (another model or flags?)", retry=False)
    if not isinstance(rows, list):  # a float array from fastparse: uniform and finite by construction
        return d
    for r in rows:
        if len(r) != d:
            raise BadResponse("rows of different widths")
        try:
            finite = all(math.isfinite(v) for v in r)
        except TypeError:
            raise BadResponse("the hidden states are not all numbers") from None
        if not finite:
            raise BadResponse("non-finite values in the hidden states")
    return d


def topk_rows(meta: dict, *, seq: int, k: int) -> tuple[list, list]:
    """[seq][K] ids and logprobs: row j is the distribution of the token after position j."""
    inputs, outputs = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not outputs:
        raise BadResponse("top-K logprobs missing (request return_logprob with top_logprobs_num)")
    dists = inputs[1:seq] + [outputs[0]]
    if len(dists) != seq:
        raise BadResponse(f"got {len(inputs)} input top-K entries for {seq} tokens")
    ids, lps = [], []
    for d in dists:
        if not isinstance(d, list) or len(d) < k:
            raise BadResponse(f"a top-K entry has fewer than {k} candidates")
        ids.append([int(c[1]) for c in d[:k]])
        lps.append([float(c[0]) for c in d[:k]])
    return ids, lps
