"""The trainer's first implementation, kept as the reference the fast one must equal (issue 33).

Dense and plain: the full T×T score matrix in float32 with a key mask, K/V repeated for grouped-query
attention, float32 log-softmax copies, the entropy per step, hit counts read to the host, and the target
from a float32 product over the whole vocabulary. Slow and memory-hungry; obviously right.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.train.model import STEP_WEIGHT, Eagle3Draft, apply_rope


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                  key_mask: torch.Tensor) -> torch.Tensor:
    """q [B, nh, T, D]; cache[i] = (k_i, v_i) [B, nh, T, D] (heads repeated); key_mask [B, T]."""
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


def unroll(m: Eagle3Draft, aux, tokens, key_mask, steps: int) -> list[torch.Tensor]:
    """The draft's unroll through the reference attention (the model's own weights)."""
    c = m.c
    B, T = tokens.shape
    hidden = m.fc(aux)
    base = torch.arange(T)
    cache, out = [], []
    layer, attn = m.midlayer, m.midlayer.self_attn
    rep = c.num_attention_heads // c.num_key_value_heads
    for k in range(steps):
        shifted = F.pad(tokens[:, 1 + k:], (0, 1 + k))[:, :T]
        emb = m.embed_tokens[shifted]
        residual = hidden
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        kk = attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        vv = attn.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = attn.rope.tables(base + k)
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        cache.append((kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)))
        att = ttt_attention(q, cache, key_mask)
        h = residual + attn.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(m.lm_head(m.norm(hidden)))
    return out


def step_losses(logits: list[torch.Tensor], target: dict):
    """(weighted loss, weighted entropy, [(hits, rows)] as Python ints)."""
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


def build_target(batch: dict, model: Eagle3Draft, head: torch.Tensor) -> dict:
    """From the final hidden state: a float32 product over the whole vocabulary."""
    mask = batch["mask"]
    lm = batch.get("loss_mask", mask)
    predicts = torch.zeros_like(mask)
    predicts[:, :-1] = lm[:, 1:] & mask[:, 1:]
    hot = model.hot_ids()
    with torch.no_grad():
        logits = (batch["final"].float() @ head.float().T)
        tgt = logits.argmax(-1)
        p = logits[..., hot].softmax(-1)
        to_draft = torch.full((model.t2d.shape[0],), -1, dtype=torch.long)
        to_draft[hot] = torch.arange(hot.shape[0])
    return {"p": p, "valid": predicts & model.t2d[tgt], "top": to_draft[tgt]}
