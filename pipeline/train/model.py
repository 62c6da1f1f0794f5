"""The EAGLE-3 draft as SGLang serves it (`LlamaForCausalLMEagle3`, sglang 0.5.23), for training.

Shape (module names are the tensor names SGLang loads, so export is a copy):
  fc            3·H_target → H, no bias: the three auxiliary hidden states fused
  midlayer      one Llama decoder layer whose q/k/v read 2H =
                concat(input_layernorm(embedding), hidden_norm(hidden)), embeddings first;
                RoPE, grouped-query attention, SiLU-gated MLP, RMSNorm, no biases; the
                residual is the hidden part
  norm          final RMSNorm; `lm_head` over the draft vocabulary (d2t / t2d map it)
  embed_tokens  the target's embedding, frozen (SGLang swaps the target's in at load;
                it is not saved with the draft)

Training-time test, as the draft runs at inference: step 0 at index j reads the target's
features at j and the token j+1 at position j. Step k ≥ 1 reads the draft's own pre-norm
output of step k−1 at the same index, the token j+1+k, at position j+k, and attends to the
step-0 keys of indices ≤ j (what SGLang's draft-extend leaves in the KV cache) plus its own
index's keys from steps 1..k (the chain it drafted). It predicts target row j+1+k. Step k's
loss weighs 0.8^k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.train import rope

STEP_WEIGHT = 0.8


@dataclass(frozen=True)
class DraftConfig:
    """Everything that fixes the draft's shapes (saved with each checkpoint)."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    # the ids the export writes to eagle_config (pipeline/draft/capture.py); checkpoints before `aux_ids` held
    # layer inputs, which the export turns into ids by subtracting 1
    aux_layer_ids: list[int] = field(default_factory=list)
    aux_ids: str = "layer-inputs"
    layout: str = "sglang-llama-eagle3"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [T, D] or [B, T, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    d = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., d:], x[..., :d]], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.c = c
        h2 = 2 * c.hidden_size
        self.q_proj = nn.Linear(h2, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        # RoPE as SGLang serves this config (rope_scaling included: pipeline/train/rope.py)
        self.rope = rope.build(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """q [B, nh, T, D], k/v [B, nh, T, D] (KV heads repeated for GQA), RoPE applied."""
        c = self.c
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope.tables(positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return q, k, v


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                  key_mask: torch.Tensor) -> torch.Tensor:
    """Step len(cache)-1's attention: causal over the step-0 keys, plus the diagonal of steps 1..k.

    q [B, nh, T, D]; cache[i] = (k_i, v_i) of step i; key_mask [B, T] (False = padding).
    Returns [B, nh, T, D].
    """
    k0, v0 = cache[0]
    T, D = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(D)
    s0 = (q @ k0.transpose(-1, -2)) * scale
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None] & key_mask[:, None, None, :]
    s0 = s0.masked_fill(~allowed, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k, _ in cache[1:]]
    w = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    out = w[..., :T] @ v0
    for i, (_, v) in enumerate(cache[1:]):
        out = out + w[..., T + i: T + i + 1] * v
    return out


class MLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)

    def forward(self, emb, hidden, positions, cache, key_mask):
        residual = hidden
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.project(x, positions)
        cache.append((k, v))
        att = ttt_attention(q, cache, key_mask)
        B, _, T, _ = att.shape
        h = residual + self.self_attn.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def frozen_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of the target's frozen embedding and LM head on this device: bf16 on a GPU (as the target
    serves them), float32 on the CPU (where bf16 matmuls are slow)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def frozen(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A frozen target tensor on `device`, in `frozen_dtype`."""
    return t.to(device=device, dtype=frozen_dtype(device))


class Eagle3Draft(nn.Module):
    """SGLang's Llama EAGLE-3 draft; the target's embedding is a frozen buffer."""

    def __init__(self, c: DraftConfig, embed: torch.Tensor) -> None:
        super().__init__()
        self.c = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        # frozen: float32 on the CPU, bf16 on a GPU (`frozen_dtype`; 2.3 GB instead of 4.7 at Kimi's size)
        self.register_buffer("embed_tokens", embed.to(frozen_dtype(embed.device)), persistent=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def hot_ids(self) -> torch.Tensor:
        """Target id of each draft id (SGLang's hot_token_id = d2t + arange)."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def unroll(self, aux: torch.Tensor, tokens: torch.Tensor, key_mask: torch.Tensor, steps: int,
               *, zero_aux: bool = False) -> list[torch.Tensor]:
        """Draft logits [B, T, Vd] of each step (see the module docstring for the alignment)."""
        B, T = tokens.shape
        hidden = self.fc(torch.zeros_like(aux) if zero_aux else aux)
        base = torch.arange(T, device=tokens.device)
        cache: list = []
        out = []
        for k in range(steps):
            shifted = F.pad(tokens[:, 1 + k:], (0, 1 + k))[:, :T]
            emb = self.embed_tokens[shifted]
            hidden = self.midlayer(emb, hidden, base + k, cache, key_mask)
            out.append(self.lm_head(self.norm(hidden)))
        return out

    def forward(self, batch: dict, target: dict, *, steps: int):
        """(weighted loss, weighted target entropy, per-step (top-1 hits, count)), called through DDP."""
        logits = self.unroll(batch["aux"], batch["token_ids"], batch["mask"], steps)
        return step_losses(logits, target)


def step_losses(logits: list[torch.Tensor], target: dict):
    """Soft cross-entropy of each step against the target rows it predicts, weighted 0.8^k."""
    p, valid, top = target["p"], target["valid"], target["top"]
    T = p.shape[1]
    losses, ents, acc, weights = [], [], [], []
    for k, lg in enumerate(logits):
        shift = 1 + k
        if T - shift < 1:
            break
        pk = p[:, shift:]
        vk = valid[:, shift:]
        logq = F.log_softmax(lg[:, : T - shift].float(), dim=-1)
        n = vk.sum().clamp_min(1)
        losses.append((-(pk * logq).sum(-1))[vk].sum() / n)
        ents.append((-(pk * torch.log(pk.clamp_min(1e-30))).sum(-1))[vk].sum() / n)
        acc.append((int(((logq.argmax(-1) == top[:, shift:]) & vk).sum()), int(vk.sum())))
        weights.append(STEP_WEIGHT ** k)
    w = torch.tensor(weights, device=p.device)
    return (torch.stack(losses) * w).sum() / w.sum(), ((torch.stack(ents) * w).sum() / w.sum()).detach(), acc


def build_target(batch: dict, model: Eagle3Draft, head: torch.Tensor | None, final_norm=None) -> dict:
    """The training target in draft-vocabulary space.

    p [B, T, Vd]: row r is the target's distribution after position r, restricted to the draft
    vocabulary and renormalised; valid [B, T]: row r counts (the token it predicts, r+1, is in
    the sample and loss-masked in, and the target's top token is in the draft vocabulary);
    top [B, T]: the target's top token as a draft id.
    """
    mask = batch["mask"]
    B, T = mask.shape
    lm = batch.get("loss_mask", mask)
    predicts = torch.zeros_like(mask)
    predicts[:, :-1] = lm[:, 1:] & mask[:, 1:]
    t2d = model.t2d
    hot = model.hot_ids()
    with torch.no_grad():
        if "final" in batch:
            final = batch["final"]
            if final_norm is not None:
                final = final_norm(final)
            logits = (final.to(head.dtype) @ head.T).float()  # head: `frozen` (bf16 on a GPU: no fp32 copy per step)
            tgt = logits.argmax(-1)
            p = logits[..., hot].softmax(-1)
        else:
            ids, logp = batch["topk_ids"], batch["topk_logprobs"].float()
            to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=ids.device)
            to_draft[hot] = torch.arange(hot.shape[0], device=ids.device)
            did = to_draft[ids]
            w = torch.where(did >= 0, logp.exp(), torch.zeros_like(logp))
            p = torch.zeros(B, T, hot.shape[0], device=ids.device).scatter_add_(-1, did.clamp_min(0), w)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
            tgt = torch.gather(ids, -1, logp.argmax(-1, keepdim=True))[..., 0]
        to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=tgt.device)
        to_draft[hot] = torch.arange(hot.shape[0], device=tgt.device)
        top = to_draft[tgt]
    return {"p": p, "valid": predicts & t2d[tgt], "top": top}


def draft_vocab(counts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [n], t2d bool [V]) for the n most frequent target tokens (ties: lower id).

    The draft ids are the chosen target ids in ascending order, as SGLang and SpecForge
    expect: target id = draft id + d2t[draft id].
    """
    V = counts.shape[0]
    order = sorted(range(V), key=lambda t: (-int(counts[t]), t))[:n]
    chosen = torch.tensor(sorted(order), dtype=torch.int64)
    d2t = chosen - torch.arange(n, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d
