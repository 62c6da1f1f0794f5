"""The EAGLE-3 draft head (arXiv 2503.01840), sized from the data.

Input at position j: the 3 auxiliary hidden states fused 3H → H, and the embedding of
the next token. One decoder layer. Output: a hidden state whose logits, through the
target's frozen LM head, predict the target's distribution one position further.
Training-time test: for step k > 0 the draft's own output hidden states replace the
target's features, as at inference.

Simplification (documented): attention in each unrolled step sees only that step's
keys (causal), not the tree of earlier steps' keys the paper's mask includes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import UserError


class DraftHead(nn.Module):
    """fc(3H → H) + one decoder layer + (frozen) LM head."""

    def __init__(self, *, hidden: int, vocab: int, lm_head: torch.Tensor | None, heads: int = 4) -> None:
        super().__init__()
        heads = heads if hidden % heads == 0 else 1
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.embed = nn.Embedding(vocab, hidden)
        self.inp = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm1, self.norm2, self.out_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        if lm_head is not None:
            self.register_buffer("lm_head", lm_head.float(), persistent=False)  # frozen target head
            self.head = None
        else:
            self.lm_head = None
            self.head = nn.Linear(hidden, vocab, bias=False)

    def step(self, feat: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One draft step over a whole sequence: [B, T, H] features, [B, T] next tokens → [B, T, H]."""
        x = self.inp(torch.cat([self.embed(tokens), feat], dim=-1))
        T = x.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))

    def forward(self, batch: dict, tgt_logp: torch.Tensor, tgt_ids: torch.Tensor | None, *, ttt: int):
        """Soft cross-entropy averaged over positions and unrolled steps (called through DDP so
        gradients are synchronised). Returns (loss, target entropy, per-step (top-1 hits, count))."""
        feat = self.fc(batch["aux"])
        tokens, mask = batch["token_ids"], batch["mask"]
        T = tokens.shape[1]
        losses, ents, acc = [], [], []
        for k in range(ttt):
            shift = 1 + k  # step k at position j: feature ≈ position j+k, token j+1+k, predicts row j+1+k
            if T - shift < 1:
                break
            h = self.step(feat[:, : T - shift], tokens[:, shift:])
            logq = F.log_softmax(self.logits(h), dim=-1)
            p_logp = tgt_logp[:, shift:]
            valid = mask[:, shift:] & mask[:, : T - shift]
            p = p_logp.exp()
            q_at = logq if tgt_ids is None else torch.gather(logq, -1, tgt_ids[:, shift:])
            n = valid.sum().clamp_min(1)
            losses.append((-(p * q_at).sum(-1))[valid].sum() / n)
            ents.append((-(p * p_logp).sum(-1))[valid].sum() / n)
            best = p_logp.argmax(-1, keepdim=True)
            target_top = best[..., 0] if tgt_ids is None else torch.gather(tgt_ids[:, shift:], -1, best)[..., 0]
            acc.append((int(((logq.argmax(-1) == target_top) & valid).sum()), int(valid.sum())))
            feat = h  # feed the draft's own outputs forward, as at inference
        return torch.stack(losses).mean(), torch.stack(ents).mean().detach(), acc

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of draft hidden states."""
        h = self.out_norm(h)
        return h @ self.lm_head.T if self.head is None else self.head(h)


def target_logprobs(batch: dict, lm_head: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p [B, T, V] or [B, T, K], ids [B, T, K] or None): row j is the distribution after position j."""
    if "final" in batch:
        return F.log_softmax(batch["final"] @ lm_head.T.float(), dim=-1), None
    return F.log_softmax(batch["topk_logprobs"], dim=-1), batch["topk_ids"]  # renormalised over the K ids


def load_lm_head(path: str) -> torch.Tensor:
    """`lm_head.weight` [V, H] from a safetensors file or a Hugging Face model directory."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.exists():
            try:
                shard = json.loads(index.read_text())["weight_map"]["lm_head.weight"]
            except (ValueError, KeyError):
                raise UserError(f"{index}: no lm_head.weight in weight_map") from None
            p = p / shard
        else:
            p = p / "model.safetensors"
    try:
        with safe_open(str(p), framework="pt") as f:
            keys = list(f.keys())
            key = "lm_head.weight" if "lm_head.weight" in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise UserError(f"{p}: no lm_head.weight tensor (found {len(keys)} tensors)")
            return f.get_tensor(key)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"--lm-head {path}: cannot read ({type(exc).__name__}: {exc})") from None
