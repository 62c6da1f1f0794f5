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

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.draft import rope
from pipeline.train.attention import ttt_attention

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
    train_max_length: int | None = None  # the longest sample trained on (--max-length): no shape, a context guard

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
        # RoPE as SGLang serves this config (rope_scaling included: pipeline/draft/rope.py)
        self.rope = rope.build(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] (never repeated for GQA), RoPE applied."""
        c = self.c
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope.tables(positions)  # float32: the rotated q and k come back in v's dtype (bf16 under
        # autocast), as the attention kernel needs one dtype for all three
        return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v


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

    def forward(self, emb, hidden, positions, cache):
        """One unrolled step; `cache` holds the (k, v) of the steps before it and gains this step's."""
        residual = hidden
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.project(x, positions)
        cache.append((k, v))
        att = ttt_attention(q, *cache[0], cache[1:])
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

    d2t: torch.Tensor  # buffers (register_buffer), declared for the type checker
    t2d: torch.Tensor
    embed_tokens: torch.Tensor

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

    def unroll(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int, *, zero_aux: bool = False) -> list[torch.Tensor]:
        """Draft logits [B, T, Vd] of each step (see the module docstring for the alignment). Samples are
        right-padded, so the causal mask alone keeps padding away from every real row."""
        B, T = tokens.shape
        hidden = self.fc(torch.zeros_like(aux) if zero_aux else aux)
        base = torch.arange(T, device=tokens.device)
        cache: list = []
        out = []
        for k in range(steps):
            shifted = F.pad(tokens[:, 1 + k:], (0, 1 + k))[:, :T]
            emb = self.embed_tokens[shifted]
            hidden = self.midlayer(emb, hidden, base + k, cache)
            out.append(self.lm_head(self.norm(hidden)))
        return out

    def forward(self, batch: dict, target: dict, *, steps: int):
        """(weighted loss, weighted target entropy, top-1 hits and counts [steps, 2] on the device), called
        through DDP."""
        logits = self.unroll(batch["aux"], batch["token_ids"], steps)
        return step_losses(logits, target)


class _SoftCrossEntropy(torch.autograd.Function):
    """−Σ p·log softmax(x) per row, in float32, keeping only x (in its own dtype) for the backward: no float32
    copy of the logits, no log-softmax tensor, lives past the call."""

    @staticmethod
    def forward(ctx, x, p):
        with torch.autocast(x.device.type, enabled=False):
            return _SoftCrossEntropy._forward(ctx, x, p)

    @staticmethod
    def _forward(ctx, x, p):
        xf = x.float()
        lse = torch.logsumexp(xf, -1)
        mass = p.sum(-1)
        ctx.save_for_backward(x, p, lse, mass)
        return lse * mass - (p * xf).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        x, p, lse, mass = ctx.saved_tensors
        q = torch.exp(x.float() - lse[..., None])
        return ((q * mass[..., None] - p) * grad[..., None]).to(x.dtype), None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[..., V] logits against a target distribution p [..., V] → [...] (float32)."""
    return _SoftCrossEntropy.apply(logits, p)


def step_losses(logits: list[torch.Tensor], target: dict):
    """Soft cross-entropy of each step against the target rows it predicts, weighted 0.8^k.

    Nothing here waits for the device: the hit counts stay on it ([steps, 2]: top-1 hits, rows) until the
    caller reads them at log time, and the target's entropy comes with the target (computed once per batch).
    """
    p, valid, top, ent = target["p"], target["valid"], target["top"], target["ent"]
    T = p.shape[1]
    loss, entropy = torch.zeros((), device=p.device), torch.zeros((), device=p.device)
    total, acc = 0.0, []
    for k, lg in enumerate(logits):
        shift = 1 + k
        if T - shift < 1:
            break
        vk = valid[:, shift:]
        n = vk.sum().clamp_min(1)
        w = STEP_WEIGHT ** k
        ce = soft_cross_entropy(lg[:, : T - shift], p[:, shift:])
        loss = loss + w * torch.where(vk, ce, 0.0).sum() / n
        entropy = entropy + w * torch.where(vk, ent[:, shift:], 0.0).sum() / n
        total += w
        acc.append(torch.stack([((lg[:, : T - shift].argmax(-1) == top[:, shift:]) & vk).sum(), vk.sum()]))
    return loss / total, (entropy / total).detach(), torch.stack(acc)


class TargetHead:
    """The target's LM head on the training device, with the draft vocabulary's rows gathered once."""

    CHUNK = 16384  # vocabulary rows per product in the full-vocabulary argmax

    def __init__(self, head: torch.Tensor, model: Eagle3Draft) -> None:
        self.full = head
        self.rows = head[model.hot_ids().to(head.device)].contiguous()

    def argmax(self, final: torch.Tensor) -> torch.Tensor:
        """The target's top token over the whole vocabulary, a chunk of rows at a time (never [B, T, V]);
        ties go to the lower id, as torch.argmax's."""
        best_val, best_id = (final @ self.full[: self.CHUNK].T).max(-1)
        for start in range(self.CHUNK, self.full.shape[0], self.CHUNK):
            val, idx = (final @ self.full[start: start + self.CHUNK].T).max(-1)
            better = val > best_val
            best_val, best_id = torch.where(better, val, best_val), torch.where(better, idx + start, best_id)
        return best_id


def build_target(batch: dict, model: Eagle3Draft, head: TargetHead | torch.Tensor | None, final_norm=None) -> dict:
    """The training target in draft-vocabulary space.

    p [B, T, Vd]: row r is the target's distribution after position r, restricted to the draft
    vocabulary and renormalised; valid [B, T]: row r counts (the token it predicts, r+1, is in
    the sample and loss-masked in, and the target's top token is in the draft vocabulary);
    top [B, T]: the target's top token as a draft id; ent [B, T]: p's entropy.

    From the final hidden state: the product runs in the head's dtype (bf16 on a GPU) over the draft rows
    only, and the softmax in float32; the full vocabulary is only needed for the argmax, taken by chunks.
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
            if head is None:
                raise ValueError("a batch with the final hidden state needs the target's head")
            if not isinstance(head, TargetHead):
                head = TargetHead(head, model)
            final = batch["final"]
            if final_norm is not None:
                final = final_norm(final)
            final = final.to(head.full.dtype)
            p = (final @ head.rows.T).float().softmax(-1)
            tgt = head.argmax(final)
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
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return {"p": p, "valid": predicts & t2d[tgt], "top": top, "ent": ent}


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
