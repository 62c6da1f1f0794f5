"""An exported draft read the way SGLang 0.5.23 reads it, and run the way SGLang runs it.

`check_export` applies `LlamaForCausalLMEagle3`'s construction and `load_weights` rules
(`srt/models/llama_eagle3.py`) to a directory: the parameters SGLang builds from
config.json, the legacy rename `midlayer` → `layers.0`, q/k/v stacked into `qkv_proj` and
gate/up into `gate_up_proj`, `d2t` → `hot_token_id = d2t + arange`, `t2d` skipped. SGLang
skips a tensor name it does not know *silently*; here it is a problem, like a missing
parameter, a wrong shape or an incomplete config. It is written from SGLang's rules alone
(config → parameter shapes), not from the trainer's module, so it checks the exporter
independently.

`SglangDraft` is the forward SGLang runs (fused qkv and gate_up, RMSNorm with the residual
add fused, the pre-norm output carried to the next draft step), with a per-position KV
cache: `extend` for accepted tokens with the target's features, `decode` for chained
draft steps. `eval-draft` measures acceptance with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.draft import rope
from pipeline.draft.format import ARCH

REQUIRED = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "hidden_act", "rms_norm_eps", "max_position_embeddings",
            "rope_theta", "vocab_size", "draft_vocab_size", "tie_word_embeddings")
LEGACY = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


@dataclass(frozen=True)
class Dims:
    H: int
    Ht: int
    n_aux: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    draft_vocab: int
    eps: float
    theta: float
    rope_scaling: dict | None
    max_position: int

    @classmethod
    def of(cls, c: dict) -> Dims:
        H = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(H=H, Ht=int(c.get("target_hidden_size") or H),
                   n_aux=int(c.get("num_aux_hidden_states") or (len(ids) if ids else 3)), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(c.get("head_dim") or H // heads),
                   inter=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                   draft_vocab=int(c.get("draft_vocab_size") or c["vocab_size"]), eps=float(c["rms_norm_eps"]),
                   theta=float(c.get("rope_theta") or 10000.0), rope_scaling=rope.from_config(c)[1],
                   max_position=int(c["max_position_embeddings"]))


def sglang_params(c: dict) -> dict[str, tuple[int, ...]]:
    """The parameters LlamaForCausalLMEagle3 builds from this config, with their shapes."""
    d = Dims.of(c)
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return {"model.embed_tokens.weight": (d.vocab, d.H), "model.fc.weight": (d.H, d.Ht * d.n_aux),
            "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, 2 * d.H),
            "model.layers.0.self_attn.o_proj.weight": (d.H, q),
            "model.layers.0.mlp.gate_up_proj.weight": (2 * d.inter, d.H),
            "model.layers.0.mlp.down_proj.weight": (d.H, d.inter),
            "model.layers.0.input_layernorm.weight": (d.H,), "model.layers.0.post_attention_layernorm.weight": (d.H,),
            "model.layers.0.hidden_norm.weight": (d.H,), "model.norm.weight": (d.H,),
            "lm_head.weight": (d.draft_vocab, d.H)}


def _shard(c: dict, shard) -> tuple[int, slice]:
    """(rows of the stacked parameter this shard fills)."""
    d = Dims.of(c)
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    spans = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), 0: (0, d.inter), 1: (d.inter, 2 * d.inter)}
    a, b = spans[shard]
    return b - a, slice(a, b)


@dataclass
class Loaded:
    """What SGLang would hold after load_weights: parameters (stacked) and hot_token_id."""

    config: dict
    params: dict[str, torch.Tensor]
    hot_token_id: torch.Tensor | None


def config_problems(c: dict) -> list[str]:
    """What in config.json SGLang needs and does not find."""
    problems = [f"config.json: no {k}" for k in REQUIRED if k not in c]
    if c.get("architectures") != [ARCH]:
        problems.append(f"config.json: architectures is {c.get('architectures')!r}, expected [{ARCH!r}]")
    if c.get("num_hidden_layers") not in (None, 1):
        problems.append(f"config.json: num_hidden_layers is {c.get('num_hidden_layers')}, expected 1")
    if c.get("hidden_act") not in (None, "silu"):
        problems.append(f"config.json: hidden_act is {c.get('hidden_act')!r}, expected 'silu'")
    if c.get("tie_word_embeddings"):
        problems.append("config.json: tie_word_embeddings is true: SGLang would use the embedding as the draft head")
    try:
        rope.from_config(c)
    except rope.RopeError as exc:
        problems.append(f"config.json: {exc}")
    given = c.get("rope_scaling")
    scaling: dict = given if isinstance(given, dict) else {}
    if rope.rope_type(scaling) == "linear" and isinstance(scaling.get("factor"), int):
        problems.append(f"config.json: rope_scaling.factor is the integer {scaling['factor']}: SGLang's "
                        "LinearScalingRotaryEmbedding takes a float (write it as a float)")
    return problems


TP_SIZES = (1, 2, 4, 8, 16)  # the tensor-parallel sizes targets are served at (Kimi on 2×8 H100: 16)


def loads_at_tp(c: dict, tp: int) -> str | None:
    """Why SGLang's LlamaAttention would refuse the draft at tensor-parallel size `tp` (None: it loads): the
    heads are split across the ranks (`total_num_heads % tp_size == 0`), and the KV heads either split
    (as many or more than the ranks) or are replicated (`tp_size % total_num_kv_heads == 0`)."""
    heads, kv = int(c.get("num_attention_heads") or 0), int(c.get("num_key_value_heads") or c.get("num_attention_heads") or 0)
    if heads <= 0 or kv <= 0:
        return "no attention heads in config.json"
    if heads % tp:
        return f"{heads} attention heads do not split across {tp} ranks"
    if kv >= tp and kv % tp or kv < tp and tp % kv:
        return f"{kv} KV heads neither split across nor replicate over {tp} ranks"
    return None


def tp_summary(c: dict) -> tuple[list[int], list[str]]:
    """(the TP sizes of TP_SIZES the draft loads at, why it does not at each of the others)."""
    ok, refused = [], []
    for tp in TP_SIZES:
        why = loads_at_tp(c, tp)
        if why is None:
            ok.append(tp)
        else:
            refused.append(f"TP {tp}: {why}")
    return ok, refused


def load_rules(c: dict, tensors: dict[str, torch.Tensor], *, embedding_from_target: bool = True) -> tuple[Loaded, list[str]]:
    """Apply SGLang's load_weights to `tensors`; (what it would hold, every problem found)."""
    problems = config_problems(c)
    if problems:
        return Loaded(c, {}, None), problems
    want = sglang_params(c)
    d = Dims.of(c)
    params: dict[str, torch.Tensor] = {}
    filled: dict[str, set[object]] = {}
    hot = None
    for name, w in tensors.items():
        orig = name
        for old, new in LEGACY.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name:
            if tuple(w.shape) != (d.draft_vocab,) or w.dtype != torch.int64:
                problems.append(f"{orig}: {w.dtype} {list(w.shape)}, expected int64 [{d.draft_vocab}]")
                continue
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            if tuple(w.shape) != (d.vocab,) or w.dtype != torch.bool:
                problems.append(f"{orig}: {w.dtype} {list(w.shape)}, expected bool [{d.vocab}]")
            continue
        for param, shard_name, shard in STACKED:
            if shard_name not in name:
                continue
            name = name.replace(shard_name, param)
            pname = name if name in want else f"model.{name}"
            if pname not in want:
                problems.append(f"{orig}: SGLang has no parameter for it (it would be skipped silently)")
                break
            rows, span = _shard(c, shard)
            expect = (rows, want[pname][1])
            if tuple(w.shape) != expect:
                problems.append(f"{orig}: shape {list(w.shape)}, SGLang expects {list(expect)}")
                break
            params.setdefault(pname, torch.zeros(want[pname]))[span] = w.float()
            filled.setdefault(pname, set()).add(shard)
            break
        else:
            pname = name if name in want else f"model.{name}"
            if pname not in want:
                problems.append(f"{orig}: SGLang has no parameter for it (it would be skipped silently)")
                continue
            if tuple(w.shape) != want[pname]:
                problems.append(f"{orig}: shape {list(w.shape)}, SGLang expects {list(want[pname])}")
                continue
            params[pname] = w.float()
    shards: dict[str, set[object]] = {"model.layers.0.self_attn.qkv_proj.weight": {"q", "k", "v"},
                                      "model.layers.0.mlp.gate_up_proj.weight": {0, 1}}
    for pname, need in shards.items():
        if pname in params and filled.get(pname) != need:
            problems.append(f"{pname}: shards {sorted(str(x) for x in need if x not in filled.get(pname, set()))} missing")
    for pname in want:
        if pname in params:
            continue
        if pname == "model.embed_tokens.weight" and embedding_from_target:
            continue  # SGLang swaps the target's embedding in
        problems.append(f"{pname}: missing (SGLang would leave it uninitialised)")
    if d.draft_vocab < d.vocab and hot is None:
        problems.append(f"d2t: missing: draft_vocab_size {d.draft_vocab} < vocab_size {d.vocab} needs the id map")
    return Loaded(c, params, hot), problems


def read_export(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors of model.safetensors); OSError/ValueError when unreadable."""
    from safetensors.torch import load_file

    directory = Path(directory)
    return json.loads((directory / "config.json").read_text()), load_file(str(directory / "model.safetensors"))


def check_export(directory: Path, *, tp: int | None = None) -> list[str]:
    """Every problem SGLang's rules find in an export directory (empty: it loads), at tensor-parallel size `tp`
    when given."""
    try:
        c, tensors = read_export(directory)
    except FileNotFoundError as exc:
        return [f"{directory}: {Path(exc.filename).name} missing"]
    except Exception as exc:  # noqa: BLE001
        return [f"{directory}: unreadable ({type(exc).__name__}: {exc})"]
    problems = load_rules(c, tensors)[1]
    why = loads_at_tp(c, tp) if tp else None
    return problems + ([f"at --tp-size {tp}: {why}"] if why else [])


class SglangDraft:
    """The draft forward as SGLang runs it, with a KV cache indexed by position (chain, top-1)."""

    def __init__(self, loaded: Loaded, embed: torch.Tensor) -> None:
        self.c = loaded.config
        self.d = Dims.of(self.c)
        # get_rope with the config's rope_theta, rope_scaling and max_position_embeddings
        self.rope = rope.build(self.d.head_dim, self.d.theta, self.d.rope_scaling, self.d.max_position)
        self.p = loaded.params
        self.embed = embed.float()
        self.hot = loaded.hot_token_id if loaded.hot_token_id is not None else torch.arange(self.d.draft_vocab)
        self.k: torch.Tensor | None = None  # [heads, L, head_dim]
        self.v: torch.Tensor | None = None
        self.zero_aux = False

    def reset(self) -> None:
        self.k = self.v = None

    def truncate(self, length: int) -> None:
        """Keep the first `length` cache entries (drop the last round's draft steps)."""
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :length], self.v[:, :length]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.p[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.d.eps))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hd = self.d.head_dim
        cos, sin = self.rope.tables(positions)
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Run n new positions; appends their KV. Returns (target ids of the argmax, pre-norm hidden [n, H])."""
        d, p = self.d, self.p
        embeds = self.embed[token_ids]
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = (torch.zeros_like(hidden) if self.zero_aux else hidden) @ p["model.fc.weight"].T
        residual = hidden
        x = torch.cat([self._norm(embeds, "model.layers.0.input_layernorm.weight"),
                       self._norm(hidden, "model.layers.0.hidden_norm.weight")], -1)
        qkv = x @ p["model.layers.0.self_attn.qkv_proj.weight"].T
        nq, nkv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        n = x.shape[0]
        q = qkv[:, :nq].view(n, d.heads, d.head_dim).transpose(0, 1)
        k = qkv[:, nq: nq + nkv].view(n, d.kv_heads, d.head_dim).transpose(0, 1)
        v = qkv[:, nq + nkv:].view(n, d.kv_heads, d.head_dim).transpose(0, 1)
        q, k = self._rope(q, positions), self._rope(k, positions)
        rep = d.heads // d.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        base = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        self.v = v if self.v is None else torch.cat([self.v, v], 1)
        L = self.k.shape[1]
        scores = q @ self.k.transpose(-1, -2) / math.sqrt(d.head_dim)
        allowed = torch.arange(L)[None, :] <= (base + torch.arange(n))[:, None]
        att = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ self.v
        att = att.transpose(0, 1).reshape(n, nq) @ p["model.layers.0.self_attn.o_proj.weight"].T
        residual = att + residual  # post_attention_layernorm(hidden, residual): add, then norm
        h = self._norm(residual, "model.layers.0.post_attention_layernorm.weight")
        gu = h @ p["model.layers.0.mlp.gate_up_proj.weight"].T
        mlp = (F.silu(gu[:, : d.inter]) * gu[:, d.inter:]) @ p["model.layers.0.mlp.down_proj.weight"].T
        residual = mlp + residual  # final norm(hidden, residual): add, norm for logits, pre-norm carried on
        logits = self._norm(residual, "model.norm.weight") @ p["lm_head.weight"].T
        self.last_logits = logits
        return self.hot[logits.argmax(-1)], residual
