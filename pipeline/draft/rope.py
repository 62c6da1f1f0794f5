"""Rotary position tables as SGLang 0.5.23 builds them for a Llama EAGLE-3 draft.

The draft is served by `LlamaForCausalLMEagle3`, whose attention asks `get_rope`
(`srt/layers/rotary_embedding/factory.py`) for its rotary embedding with the draft
config's `rope_theta`, `rope_scaling` and `max_position_embeddings`. Each type changes the
inverse frequencies, the positions or the cos/sin magnitude:

  default  inv_freq = 1 / θ^(2i/d)
  linear   positions divided by `factor` (`LinearScalingRotaryEmbedding`)
  dynamic  a static cache at base θ·(f² − f + 1)^(d/(d−2)) (`DynamicNTKScalingRotaryEmbedding`:
           max_len = max_position·f, and its base formula reads f·max_len/max_position)
  llama3   wavelengths beyond original_max/low_freq_factor divided by `factor`, those below
           original_max/high_freq_factor kept, a smooth blend between (`Llama3RotaryEmbedding`)
  yarn     interpolated and extrapolated frequencies blended over YaRN's correction range
           (beta_fast, beta_slow over original_max_position_embeddings, floor/ceil unless
           truncate is false), and cos/sin multiplied by mscale: 0.1·ln(f) + 1, or the ratio
           of yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim) when both are
           given, times attn_factor (`YaRNScalingRotaryEmbedding`)

The trainer and `eval-draft`'s forward both use these tables, and the export writes the
normalised `rope_scaling` the draft was trained with. Any other type (deepseek_yarn,
longrope, mrope sections, dynamic with alpha …) is refused in one line before step 1: a
draft trained with other angles than it is served with loses its acceptance silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.errors import UserError

SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn")
# the keys get_rope reads for each type (the export writes these and nothing else)
KEYS = {"linear": ("factor",), "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings", "extrapolation_factor", "attn_factor", "beta_fast",
                 "beta_slow", "mscale", "mscale_all_dim", "truncate")}


class RopeError(UserError):
    """A rope_scaling the draft cannot be trained with as SGLang would serve it."""


def rope_type(scaling: dict | None) -> str:
    """The scaling's type as get_rope reads it ("rope_type", else the older "type"); "default" for none."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type"))
    return str(kind) if kind is not None else ""


def normalise(scaling, *, where: str = "rope_scaling") -> dict | None:
    """The scaling the draft trains with and the export writes: {"rope_type": …, and the type's keys}, or
    None for plain RoPE. Refuses, in one line, a type SGLang would serve differently from these tables."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise RopeError(f"{where}: {scaling!r} is not an object; give null or e.g. {{\"rope_type\": \"llama3\", ...}}")
    kind = rope_type(scaling)
    problem = None
    if kind not in SUPPORTED:
        problem = f"rope type {kind or '(none given)'!r} is not one the draft can be trained with"
    elif "mrope_section" in scaling or scaling.get("use_fope"):
        problem = "multimodal (mrope) or Fourier RoPE is not one the draft can be trained with"
    elif kind == "dynamic" and "alpha" in scaling:
        problem = "dynamic NTK with alpha is not one the draft can be trained with"
    if problem:
        raise RopeError(f"{where}: {problem}; supported: {', '.join(SUPPORTED)} (SGLang's get_rope for a Llama draft)")
    if kind == "default":
        return None
    out: dict[str, object] = {"rope_type": kind}
    for key in KEYS[kind]:
        if key in scaling and scaling[key] is not None:
            value = scaling[key]
            if key != "truncate" and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise RopeError(f"{where}.{key}: {value!r} is not a number")
            out[key] = value
    factor = out.get("factor")
    if isinstance(factor, int | float):
        if factor <= 0:
            raise RopeError(f"{where}.factor: {factor} must be positive")
        out["factor"] = float(factor)  # SGLang's LinearScalingRotaryEmbedding refuses an int factor; a float means the same
    return out


def from_config(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, normalised rope_scaling) of a Hugging Face config, as SGLang's Llama reads it:
    transformers v5's `rope_parameters` first, then `rope_theta` / `rope_scaling`; a top-level
    `original_max_position_embeddings` joins the scaling."""
    params = config.get("rope_parameters")
    scaling: dict | None
    if isinstance(params, dict):
        theta, scaling = params.get("rope_theta", 10000.0), dict(params)
        scaling.pop("rope_theta", None)
    else:
        theta, given = config.get("rope_theta") or 10000.0, config.get("rope_scaling")
        scaling = dict(given) if isinstance(given, dict) else given
    if isinstance(scaling, dict) and config.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return float(theta), normalise(scaling)


@dataclass(frozen=True)
class Rope:
    """What a draft attention needs to rotate q and k: frequencies, a position scale and a magnitude."""

    inv_freq: torch.Tensor  # [head_dim / 2], float32
    position_scale: float = 1.0
    mscale: float = 1.0

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, head_dim] in Llama's rotate-half layout (float32)."""
        pos = positions.float()
        if self.position_scale != 1.0:
            pos = pos / self.position_scale
        ang = pos[..., None] * self.inv_freq.to(positions.device)
        cos, sin = ang.cos(), ang.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def build(head_dim: int, theta: float, scaling: dict | None, max_position: int) -> Rope:
    """The rotary embedding get_rope gives a Llama draft with this config (scaling: `normalise`d)."""
    kind, s = rope_type(scaling), scaling or {}
    factor = float(s.get("factor", 1.0))
    if kind == "default":
        return Rope(_base_inv_freq(theta, head_dim))
    if kind == "linear":
        return Rope(_base_inv_freq(theta, head_dim), position_scale=factor)
    if kind == "dynamic":
        base = theta * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
        return Rope(_base_inv_freq(base, head_dim))
    if kind == "llama3":
        inv = _base_inv_freq(theta, head_dim)
        original = float(s.get("original_max_position_embeddings", max_position))
        low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        wave = 2 * math.pi / inv
        smooth = (original / wave - low) / (high - low) if low != high else torch.zeros_like(inv)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wave < original / high, inv, torch.where(wave > original / low, inv / factor, blended))
        return Rope(inv)
    if kind == "yarn":
        original = float(s.get("original_max_position_embeddings", max_position))
        beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)
        pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - lo) / (hi - lo)).clamp(0, 1)
        mask = (1 - ramp) * float(s.get("extrapolation_factor", 1))
        inv = interpolated * (1 - mask) + extrapolated * mask
        if s.get("mscale") is not None and s.get("mscale_all_dim") is not None:
            mscale = _yarn_mscale(factor, float(s["mscale"])) / _yarn_mscale(factor, float(s["mscale_all_dim"]))
        else:
            mscale = _yarn_mscale(factor)
        return Rope(inv, mscale=float(mscale) * float(s.get("attn_factor", 1)))
    raise RopeError(f"rope_scaling: rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
