"""The hidden states of a `/generate` answer, parsed straight from its bytes into one float array.

Stock SGLang returns hidden states only as JSON (`meta_info.hidden_states`, `.tolist()` on the
server): at H = 7,168 with 3 aux layers a 512-token answer holds 11 million floats, about 240 MB of
text. `json.loads` turns each into a Python float (24 bytes, plus 8 for the list slot: 350 MB for
that answer) and the client then copies them into a tensor, ~0.43 s of CPU per million floats. Here the prefill matrix is found in the bytes, its brackets blanked, and its numbers parsed by
simdjson a few megabytes at a time straight into float arrays (`as_buffer`: no Python object per
value; its conversion is correctly rounded like Python's `float()`, so the values are bit for bit
those of `json.loads`): ~0.03 s of CPU per million floats against ~0.45 through json.loads — simdjson's
number parsing is that floor (bench/RESULTS.md, the client's profile); only the rest of the answer (ids, top-K
logprobs) goes through `json.loads`. Rows are found with one memchr-fast find each, counted and their widths
checked.

An answer laid out otherwise than SGLang's (`"hidden_states": [[[…], …], […], …]`, or a flat
single-row prefill `[[…], …]`) returns None: the caller falls back to `json.loads`, which reports
what is wrong with it.
"""

from __future__ import annotations

import bisect
import json

import numpy as np

from pipeline.extract.response import BadResponse

KEY = b'"hidden_states"'
_WS = b" \t\r\n"
_BLANK = bytes.maketrans(b"[]", b"  ")
CHUNK_BYTES = 4 << 20  # text parsed per step


def available() -> bool:
    """Whether pysimdjson (the fast path's parser) is installed."""
    try:
        import simdjson  # noqa: F401
    except ImportError:
        return False
    return True


def _skip(buf: bytes, i: int) -> int:
    while i < len(buf) and buf[i] in _WS:
        i += 1
    return i


def split(content: bytes) -> tuple[dict, np.ndarray] | None:
    """(the answer without its hidden states, the prefill rows as float32 [rows, D]); None when the
    layout is not SGLang's. `content` may be bytes or a bytearray. Raises BadResponse for an answer that is SGLang's layout but unusable
    (rows of different widths, text that is not numbers)."""
    at = content.find(KEY)
    if at < 0 or content.find(KEY, at + len(KEY)) >= 0:
        return None  # no hidden states, or the key twice (a nested copy): let json.loads decide
    i = _skip(content, at + len(KEY))
    if i >= len(content) or content[i] != ord(":"):
        return None
    outer = _skip(content, i + 1)
    if outer >= len(content) or content[outer] != ord("["):
        return None
    first = _skip(content, outer + 1)
    if first >= len(content) or content[first] != ord("["):
        return None
    inner = _skip(content, first + 1)
    if inner < len(content) and content[inner] == ord("["):  # [rows][D] matrix
        found = _row_ends(content, inner)  # rows hold no brackets: "]" then "]" closes the matrix
        if found is None:
            return None
        starts, ends = found  # "[r0],[r1],…,[rN]"
        after = _skip(content, ends[-1] + 1) + 1
    else:  # a single-row prefill flattened to [D]
        end = content.find(b"]", first)
        if end < 0:
            return None
        starts, ends = [first], [end]
        after = end + 1
    # what follows the prefill: decode rows ("[…]", flat), then the list's closing bracket
    j = _skip(content, after)
    while j < len(content) and content[j] == ord(","):
        k = _skip(content, j + 1)
        if k >= len(content) or content[k] != ord("["):
            return None
        close = content.find(b"]", k)
        if close < 0 or content.find(b"[", k + 1, close) >= 0:
            return None
        j = _skip(content, close + 1)
    if j >= len(content) or content[j] != ord("]"):
        return None
    rows = _matrix(content, starts, ends)
    if rows is None:
        return None
    return json.loads(bytes(content[:outer]) + b"[]" + bytes(content[j + 1:])), rows


def _row_ends(buf, start: int) -> tuple[list[int], list[int]] | None:
    """Each row's opening "[" and closing "]" from `start` (the first row's "["), up to the row followed by the
    matrix's own "]"; None where a row is followed by anything else than "," and a row, or "]" (json.loads
    decides). One memchr-fast find per row: a search for "]]" reads the whole text at a third of that speed."""
    starts, ends, pos = [start], [], start
    while True:
        c = buf.find(b"]", pos)
        if c < 0:
            return None
        ends.append(c)
        nxt = _skip(buf, c + 1)
        if nxt >= len(buf):
            return None
        if buf[nxt] == 0x5D:  # "]": the matrix closes
            return starts, ends
        row = _skip(buf, nxt + 1)
        if buf[nxt] != 0x2C or row >= len(buf) or buf[row] != 0x5B:  # "," then "["
            return None
        starts.append(row)
        pos = row + 1


def _matrix(buf, starts: list[int], ends: list[int]) -> np.ndarray | None:
    """Parse the rows of buf, each from its "[" (`starts`) to its "]" (`ends`) — "[a,b,…],[c,d,…],…" — into [rows, D] float32, every row with D numbers, about CHUNK_BYTES of text at a time, into one array
    allocated once (no Python float per value, no copy of the text where `buf` is a bytearray: the byte before a
    chunk and the one after it are turned into brackets for the parse and put back). None where simdjson refuses
    the text (NaN, Infinity, strings: the caller's json.loads path says what is wrong)."""
    import simdjson

    parser, out, i, d = simdjson.Parser(), None, 0, None
    rows_total = len(ends)
    view = memoryview(buf) if isinstance(buf, bytearray) else None
    while i < rows_total:
        o = starts[i]
        j = min(bisect.bisect_left(ends, o + CHUNK_BYTES, lo=i), rows_total - 1)
        c = ends[j]
        try:
            if view is not None and o > 0 and c + 1 < len(buf):
                before, after = buf[o - 1], buf[c + 1]
                buf[o - 1], buf[c + 1] = 0x5B, 0x5D  # "[" … "]"
                try:
                    rows = parser.parse(view[o - 1:c + 2])
                finally:
                    buf[o - 1], buf[c + 1] = before, after
            else:
                rows = parser.parse(b"[" + bytes(buf[o:c + 1]) + b"]")
            if not isinstance(rows, simdjson.Array):  # (the text is wrapped in brackets: always an array)
                return None
            widths = {len(r) if isinstance(r, simdjson.Array) else -1 for r in rows}
            k = len(rows)
            if len(widths) != 1 or min(widths) <= 0 or (d is not None and d not in widths) or k != j - i + 1:
                raise BadResponse("rows of different widths")
            d = widths.pop()
            if out is None:
                out = np.empty((rows_total, d), dtype=np.float32)
            with np.errstate(over="ignore"):  # a value beyond float32 becomes inf: refused below
                # double → float32, rounded as torch.tensor(list, dtype=float32) rounds
                out[i:i + k] = np.frombuffer(rows.as_buffer(of_type="d"), dtype=np.float64).reshape(k, d)
            i += k
            del rows
        except (ValueError, TypeError):  # simdjson: not JSON, or not all floats (NaN, strings, integers)
            return None
    if out is None or i != rows_total:
        raise BadResponse("meta_info.hidden_states has an unexpected shape")
    if not np.isfinite(out).all():
        raise BadResponse("non-finite values in the hidden states")
    return out
