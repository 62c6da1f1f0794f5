"""Atomic per-sample safetensors files: temp name in the same directory, fsync, rename."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

_OS_ERROR = re.compile(r"\(os error (\d+)\)")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def sample_path(out: Path, idx: int) -> Path:
    """OUT/hidden_states/hs_{idx}.safetensors."""
    return out / "hidden_states" / f"hs_{idx}.safetensors"


def tensors_for(*, token_ids: list[int], rows, layers: int, dtype: torch.dtype,
                topk: tuple[list, list] | None, loss_mask: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The sample's tensors: token_ids [seq] int64, hidden_states [seq, L, H] (+ top-K, + loss_mask [seq] uint8).
    `rows`: lists of floats, or a float32 [seq, L·H] array (fastparse), converted alike."""
    hs = torch.tensor(rows, dtype=torch.float32) if isinstance(rows, list) else torch.from_numpy(rows)
    seq, d = hs.shape
    out = {"token_ids": torch.tensor(token_ids, dtype=torch.int64),
           "hidden_states": hs.reshape(seq, layers, d // layers).to(dtype).contiguous()}
    if loss_mask is not None:
        out["loss_mask"] = torch.tensor(loss_mask, dtype=torch.uint8)
    if topk:
        out["target_topk_ids"] = torch.tensor(topk[0], dtype=torch.int64)
        out["target_topk_logprobs"] = torch.tensor(topk[1], dtype=torch.float32)
    return out


def write_sample(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically: temp name in the same directory, fsync, rename.

    safetensors writes from its own buffers (no Python bytes copy of a 60 MB sample);
    its I/O errors come back as OSError with the original errno, so a full disk is
    recognised. On any error no file is left under either name.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except Exception as exc:  # SafetensorError: "… (os error 28)"
            found = _OS_ERROR.search(str(exc))
            if not found:
                raise
            code = int(found.group(1))
            raise OSError(code, os.strerror(code)) from None
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def remove_temp_files(directory: Path) -> int:
    """Delete temp files a crash left behind; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(".") and (p.name.endswith(".tmp") or p.name.startswith(".tmp")):
                p.unlink(missing_ok=True)
                n += 1
    return n
