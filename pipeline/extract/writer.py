"""Atomic per-sample safetensors files: temp name in the same directory, fsync, rename; and their reading back.

Written with numpy and safetensors' own serializer (the one `safetensors.torch.save_file`
calls), so the extraction client never imports torch (2.4 CPU-s a start) and its files are
byte for byte what the torch path wrote: bf16 is rounded to nearest even, as torch rounds.
Read back (`read_sample`, for `verify`) from the format's own layout with numpy, so that the
bot's service checks an extraction without torch (its import: ~2 CPU-s and ~300 MB held for good).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from pipeline.durable import fsync_path
from pipeline.fileperm import honour_umask
from pipeline.layout import sample_path

__all__ = ["DTYPES", "Tensor", "non_finite", "read_sample", "remove_temp_files", "sample_path", "tensors_for",
           "to_bf16_bits", "write_sample"]

_OS_ERROR = re.compile(r"\(os error (\d+)\)")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


class Tensor:
    """A tensor to write: safetensors' dtype name and a C-contiguous array holding its bytes
    (uint16 bit patterns for bfloat16, which numpy has no type for)."""

    __slots__ = ("dtype", "array")

    def __init__(self, dtype: str, array: np.ndarray) -> None:
        self.dtype, self.array = dtype, np.ascontiguousarray(array)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns, rounded to nearest even; any NaN → 0xFFFF, as torch 2.13 on CPU
    converts it (the client refuses non-finite answers before this; the rule is kept for fidelity)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    t = u >> 16
    t &= 1
    t += 0x7FFF
    t += u  # no overflow short of a NaN's bit pattern, which is replaced below
    t >>= 16
    bits = t.astype(np.uint16)
    del t
    nan = np.isnan(a)
    if nan.any():
        bits[nan] = 0xFFFF
    return bits


def _cast(hs: np.ndarray, dtype: str) -> Tensor:
    if dtype == "bfloat16":
        return Tensor(dtype, to_bf16_bits(hs))
    with np.errstate(over="ignore"):  # beyond fp16's range is inf, as torch casts it, without a warning
        return Tensor(dtype, hs.astype(np.float16 if dtype == "float16" else np.float32, copy=False))


def tensors_for(*, token_ids: list[int], rows, layers: int, dtype: str,
                topk: tuple[list, list] | None, loss_mask: list[int] | None = None) -> dict[str, Tensor]:
    """The sample's tensors: token_ids [seq] int64, hidden_states [seq, L, H] (+ top-K, + loss_mask [seq] uint8).
    `rows`: lists of floats, or a float32 [seq, L·H] array (fastparse), converted alike. `dtype`: a name
    DTYPES knows (`--dtype`'s: bf16, fp16, fp32, or safetensors' own)."""
    hs = np.asarray(rows, dtype=np.float32)
    seq, d = hs.shape
    out = {"token_ids": Tensor("int64", np.asarray(token_ids, dtype=np.int64)),
           "hidden_states": _cast(hs.reshape(seq, layers, d // layers), DTYPES[dtype])}
    if loss_mask is not None:
        out["loss_mask"] = Tensor("uint8", np.asarray(loss_mask, dtype=np.uint8))
    if topk:
        out["target_topk_ids"] = Tensor("int64", np.asarray(topk[0], dtype=np.int64))
        out["target_topk_logprobs"] = Tensor("float32", np.asarray(topk[1], dtype=np.float32))
    return out


def _save(tensors: dict[str, Tensor], path: str, metadata: dict[str, str]) -> None:
    specs = {k: TensorSpec(dtype=t.dtype, shape=t.shape, data_ptr=t.array.ctypes.data, data_len=t.array.nbytes)
             for k, t in tensors.items()}
    serialize_file(specs, path, metadata=metadata)  # `tensors` keeps the arrays alive meanwhile
    honour_umask(path)  # safetensors creates it 0600: the trainer may run as another user


def write_sample(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically: temp name in the same directory, fsync, rename.

    safetensors writes from its own buffers (no Python bytes copy of a 60 MB sample);
    its I/O errors come back as OSError with the original errno, so a full disk is
    recognised. On any error no file is left under either name.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        try:
            _save(tensors, str(tmp), metadata)
        except Exception as exc:  # SafetensorError: "… (os error 28)"
            found = _OS_ERROR.search(str(exc))
            if not found:
                raise
            code = int(found.group(1))
            raise OSError(code, os.strerror(code)) from None
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)  # the rename too: the manifest will call this sample done
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# the file header's dtype codes: safetensors' names (TensorSpec's) and the numpy type holding the bytes
_CODES = {"BF16": ("bfloat16", np.uint16), "F16": ("float16", np.float16), "F32": ("float32", np.float32),
          "F64": ("float64", np.float64), "I64": ("int64", np.int64), "I32": ("int32", np.int32),
          "I16": ("int16", np.int16), "I8": ("int8", np.int8), "U8": ("uint8", np.uint8), "BOOL": ("bool", np.bool_)}
_MAX_HEADER = 100_000_000  # safetensors' own limit


def read_sample(path: Path | str) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, as written (bfloat16 as uint16 bit patterns). The layout: an 8-byte
    little-endian header length, the JSON header (dtype, shape, data_offsets per tensor), then the data.
    Raises ValueError (or OSError) on a file that does not hold what its header says."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"no safetensors header ({size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("the header is not JSON") from None
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out, base = {}, 8 + n
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, np_type = _CODES[spec["dtype"]]
                shape = [int(d) for d in spec["shape"]]
                start, stop = (int(o) for o in spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{name}: not a tensor this reader knows ({spec!r:.80})") from None
            if stop - start != math.prod(shape) * np.dtype(np_type).itemsize or start < 0 or base + stop > size:
                raise ValueError(f"{name}: its data ({start}..{stop}) does not match shape {shape} in a {size}-byte file")
            fh.seek(base + start)
            out[name] = Tensor(dtype, np.frombuffer(fh.read(stop - start), dtype=np_type).reshape(shape))
    return out


def non_finite(t: Tensor) -> bool:
    """Whether a floating tensor holds a NaN or an infinity (bfloat16: the exponent's bits all set)."""
    if t.dtype == "bfloat16":
        return bool(((t.array & 0x7F80) == 0x7F80).any())
    return t.array.dtype.kind == "f" and not bool(np.isfinite(t.array).all())


def remove_temp_files(directory: Path) -> int:
    """Delete temp files a crash left behind; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(".") and (p.name.endswith(".tmp") or p.name.startswith(".tmp")):
                p.unlink(missing_ok=True)
                n += 1
    return n
