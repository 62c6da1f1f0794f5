"""The extraction's file layout, shared by its writer, its verifier and the trainer that reads it; and the
regeneration's (OUT.jsonl, with OUT.jsonl.parts/manifest.sqlite and OUT.jsonl.parts/lines/<idx>.json).

OUT/manifest.sqlite (one row per sample; see pipeline/manifest.py) and one safetensors file a
sample: OUT/hidden_states/hs_{idx}.safetensors, with token_ids [seq] int64, hidden_states
[seq, L, H] (aux layers, then the final one where the server returns it), and optionally
loss_mask [seq] uint8, target_topk_ids / target_topk_logprobs [seq, K].
"""

from __future__ import annotations

from pathlib import Path

HIDDEN_DIR = "hidden_states"


def sample_path(out: Path, idx: int) -> Path:
    """OUT/hidden_states/hs_{idx}.safetensors."""
    return out / HIDDEN_DIR / f"hs_{idx}.safetensors"


def parts_dir(out: Path) -> Path:
    """Where a regeneration into `out` keeps its manifest and its finished conversations."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def lines_dir(out: Path) -> Path:
    """One JSON file per regenerated conversation: parts_dir(out)/lines/<idx>.json."""
    return parts_dir(out) / "lines"
