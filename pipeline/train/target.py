"""The target model's tensors the draft needs: embedding, LM head, final norm (and its config).

Read from a Hugging Face directory through `model.safetensors.index.json` (or a single
`model.safetensors`), one tensor at a time: never the whole model. A single safetensors
file holding the tensors is accepted too (`--lm-head FILE`, the older flag).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError

# Where a multimodal checkpoint nests the text model: Kimi-K2.5 (`language_model.model.embed_tokens.weight`,
# `language_model.lm_head.weight`) and transformers' newer layout (`model.language_model.embed_tokens.weight`,
# a top-level `lm_head.weight`).
PREFIXES = ("", "language_model.", "model.language_model.")
NAMES = {"embed": tuple(f"{p}{n}" for p in PREFIXES for n in ("model.embed_tokens.weight", "embed_tokens.weight")),
         "head": tuple(f"{p}lm_head.weight" for p in PREFIXES),
         "norm": tuple(f"{p}{n}" for p in PREFIXES for n in ("model.norm.weight", "norm.weight"))}
TEXT_CONFIG_KEYS = ("text_config", "language_config")  # Kimi-K2.5, Llava-style and DeepSeek-VL configs


def text_config(config: dict) -> dict:
    """The text model's config: a nested `text_config` / `language_config` (with the outer keys it lacks, such
    as `tie_word_embeddings`), else the config itself."""
    for key in TEXT_CONFIG_KEYS:
        inner = config.get(key)
        if isinstance(inner, dict):
            return {**{k: v for k, v in config.items() if k not in TEXT_CONFIG_KEYS}, **inner}
    return config


@dataclass
class Target:
    """What the trainer reads of the target model."""

    embed: torch.Tensor  # [V, H]
    head: torch.Tensor  # [V, H]
    norm: torch.Tensor | None  # [H]
    config: dict
    source: str

    @property
    def vocab(self) -> int:
        return self.head.shape[0]

    @property
    def hidden(self) -> int:
        return self.head.shape[1]


def _weight_map(p: Path) -> dict[str, Path]:
    if p.is_file():
        files = [p]
    else:
        index = p / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"{index}: not a safetensors index (no weight_map)") from None
            return {k: p / v for k, v in wm.items()}
        files = [p / "model.safetensors"] if (p / "model.safetensors").exists() else sorted(p.glob("*.safetensors"))
        if not files:
            raise UserError(f"{p}: no model.safetensors.index.json and no *.safetensors files: not a model directory")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f for k in fh.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def _read(wm: dict[str, Path], names: tuple[str, ...]) -> torch.Tensor | None:
    from safetensors import safe_open

    for name in names:
        if name in wm:
            with safe_open(str(wm[name]), framework="pt") as fh:
                return fh.get_tensor(name)
    return None


def load_target(path: str, *, need_norm: bool) -> Target:
    """Read embedding, head and (when needed or present) the final norm; one-line errors."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"--target-model {path}: no such file or directory")
    try:
        wm = _weight_map(p)
        found = {k: _read(wm, names) for k, names in NAMES.items()}
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt shard, a bad header
        raise UserError(f"--target-model {path}: cannot read ({type(exc).__name__}: {exc})") from None
    config = {}
    cfg = p / "config.json" if p.is_dir() else p.with_name("config.json")
    if cfg.exists():
        try:
            config = json.loads(cfg.read_text())
        except ValueError:
            raise UserError(f"{cfg}: not JSON") from None
        config = text_config(config) if isinstance(config, dict) else {}
    if found["head"] is None and found["embed"] is not None and config.get("tie_word_embeddings", True):
        found["head"] = found["embed"]
    missing = [NAMES[k][0] for k in ("embed", "head") if found[k] is None]
    if need_norm and found["norm"] is None:
        missing.append(NAMES["norm"][0] + " (the files' last slot is pre-norm)")
    if missing:
        raise UserError(f"--target-model {path}: no tensor {', '.join(missing)}; give the target's Hugging Face "
                        "directory (its model.safetensors.index.json names every tensor)")
    embed, head = found["embed"], found["head"]  # as stored (bf16 on real targets): the trainer casts them where used
    if embed is None or head is None:  # (said above as missing)
        raise UserError(f"--target-model {path}: no embedding or lm_head tensor")
    if embed.shape != head.shape:
        raise UserError(f"--target-model {path}: embedding is {list(embed.shape)} but lm_head is {list(head.shape)}")
    norm = None if found["norm"] is None else found["norm"].float()  # [H]: small
    return Target(embed, head, norm, config, str(p))
