"""Atomic per-sample safetensors files: temp name in the same directory, fsync, rename."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def sample_path(out: Path, idx: int) -> Path:
    """OUT/hidden_states/hs_{idx}.safetensors."""
    return out / "hidden_states" / f"hs_{idx}.safetensors"


def tensors_for(*, token_ids: list[int], rows: list, layers: int, dtype: torch.dtype,
                topk: tuple[list, list] | None) -> dict[str, torch.Tensor]:
    """The sample's tensors: token_ids [seq] int64, hidden_states [seq, L, H] (+ top-K)."""
    hs = torch.tensor(rows, dtype=torch.float32)
    seq, d = hs.shape
    out = {"token_ids": torch.tensor(token_ids, dtype=torch.int64),
           "hidden_states": hs.reshape(seq, layers, d // layers).to(dtype).contiguous()}
    if topk:
        out["target_topk_ids"] = torch.tensor(topk[0], dtype=torch.int64)
        out["target_topk_logprobs"] = torch.tensor(topk[1], dtype=torch.float32)
    return out


def write_atomic(path: Path, data: bytes) -> int:
    """Write `data` to `path` atomically; on any error no file is left under either name."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(data)


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes with string metadata."""
    return save(tensors, metadata=metadata)


def remove_temp_files(directory: Path) -> int:
    """Delete temp files a crash left behind; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
                n += 1
    return n
