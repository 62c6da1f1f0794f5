"""A tiny Llama-style causal LM standing in for the target model (CPU, every weight seeded).

Why it looks the way it does:
- **The same model in every process.** Every tensor is drawn from one seeded generator
  (no module keeps torch's unseeded default init), so a toy server, an extraction, an
  export and an evaluation made by different processes agree bit for bit.
- **The next token depends on more than the last token.** Layer 1 holds previous-token
  heads: their queries and keys read a constant channel of the residual stream, and RoPE
  makes the score peak one position back (q·k = Σ|u_f|² cos((i − j + 1)·θ_f)); their
  values copy the token-identity channels into a separate "previous token" channel. The
  LM head reads both channels, so the target's next token is a function of the last two
  tokens: a bigram table ("token → most frequent next token") is far from it, while a
  draft that reads the auxiliary hidden states (which carry both channels) can match it.
  The other layers are small random Llama blocks (attention + SiLU-gated MLP) that add
  the usual mixing on top.
- **Llama conventions where the pipeline reads them:** RMSNorm, `model.embed_tokens`,
  `model.norm`, `lm_head`; auxiliary hidden states are the *inputs* of layers
  [2, N//2, N−3] as SGLang captures them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from pipeline.draft.capture import default_capture
from pipeline.fileperm import honour_umask
from pipeline.toy.tokenizer import IM_END_ID, write_tokenizer

VOCAB = 256
HIDDEN = 64
LAYERS = 8
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
CONTEXT = 2048
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
SEED = 1234
CONST = slice(0, 4)  # a constant channel (the previous-token heads' queries and keys read it)
IDENT = slice(4, 34)  # the current token's identity
PREV = slice(34, 64)  # the previous token's identity, written by layer 1
PREV_LAYER = 1
PREV_SCORE = 6.0  # |u_f|² per rotation pair: the previous position wins by a wide margin
PREV_GAIN = 1.1  # how strongly the previous token steers the next one, relative to the current
NOISE = 0.08  # scale of the random blocks' weights
LOGIT_SCALE = 2.2


def aux_layer_ids(n_layers: int = LAYERS) -> list[int]:
    """SGLang's default EAGLE-3 capture: inputs of layers [2, N//2, N-3]."""
    return default_capture(n_layers)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """Llama's RMSNorm."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(positions: torch.Tensor, theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, HEAD_DIM] of Llama's rotate-half rotary embedding at `positions` [T]: once per forward,
    every layer's queries and keys share them."""
    d = HEAD_DIM
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Llama's rotate-half layout: x [..., T, D], cos and sin [T, D] (`rope_tables`)."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    """A Llama decoder layer without biases: RMSNorm, attention with RoPE, SiLU-gated MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(HIDDEN))
        self.post_attention_layernorm = nn.Parameter(torch.ones(HIDDEN))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                cache: dict | None = None) -> torch.Tensor:
        """x [T, H] at positions after those in `cache` (the keys and values of earlier positions, extended
        here: a decode step attends to the prompt without recomputing it); `tables`: RoPE's at those positions."""
        T = x.shape[0]
        start = 0 if not cache else cache["k"].shape[1]
        h = rms_norm(x, self.input_layernorm)
        q, k, v = (p(h).view(T, HEADS, HEAD_DIM).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rope(q, *tables), rope(k, *tables)
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
            cache["k"], cache["v"] = k, v
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        if T > 1:  # causal mask; a one-token decode step attends to every position before it, nothing to mask
            future = torch.triu(torch.ones(T, start + T, dtype=torch.bool), start + 1)
            scores = scores.masked_fill(future, float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, HIDDEN)
        x = x + self.o_proj(att)
        h = rms_norm(x, self.post_attention_layernorm)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class ToyLM(nn.Module):
    """The toy target: embeddings, LAYERS blocks, final RMSNorm, LM head; deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for p in self.parameters():  # every tensor from the seeded generator
                if p.dim() == 1:
                    p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * NOISE / math.sqrt(p.shape[1]))
            emb = torch.zeros(VOCAB, HIDDEN)
            emb[:, CONST] = 1.0
            ident = torch.randn(VOCAB, IDENT.stop - IDENT.start, generator=gen)
            emb[:, IDENT] = ident / ident.norm(dim=1, keepdim=True) * math.sqrt(IDENT.stop - IDENT.start)
            self.embed_tokens.weight.copy_(emb)
            prev = self.layers[PREV_LAYER]
            assert isinstance(prev, Block)
            self._previous_token_heads(prev)
            head = torch.randn(VOCAB, HIDDEN, generator=gen) * LOGIT_SCALE / math.sqrt(IDENT.stop - IDENT.start)
            head[:, CONST] = 0.0
            head = head / head.norm(dim=1, keepdim=True) * LOGIT_SCALE * math.sqrt(HIDDEN / (IDENT.stop - IDENT.start))
            self.lm_head.weight.copy_(head)
        self.eval()

    @staticmethod
    def _previous_token_heads(block: Block) -> None:
        """Every head of `block` attends one position back and copies identity → PREV."""
        block.input_layernorm.fill_(1.0)
        n_const = CONST.stop - CONST.start
        half = HEAD_DIM // 2
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        # after RMSNorm the constant channel reads about 1 / rms(embedding row)
        scale = math.sqrt(HIDDEN / (n_const + IDENT.stop - IDENT.start))
        u = torch.zeros(HEAD_DIM)
        u[:half] = math.sqrt(PREV_SCORE * math.sqrt(HEAD_DIM)) / scale  # q = (u1, 0): one vector per pair
        w = torch.zeros(HEAD_DIM)  # k = R(θ)·q, so q_j·k_i peaks at i = j − 1
        w[:half], w[half:] = u[:half] * inv.cos(), u[:half] * inv.sin()
        q = torch.zeros(HIDDEN, HIDDEN)
        k = torch.zeros(HIDDEN, HIDDEN)
        v = torch.zeros(HIDDEN, HIDDEN)
        o = torch.zeros(HIDDEN, HIDDEN)
        ident = list(range(IDENT.start, IDENT.stop))
        prev = list(range(PREV.start, PREV.stop))
        for h in range(HEADS):
            rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
            q[rows, CONST.start] = u
            k[rows, CONST.start] = w
            for j, (src, dst) in enumerate(zip(ident[h::HEADS], prev[h::HEADS], strict=True)):
                v[h * HEAD_DIM + j, src] = 1.0
                o[dst, h * HEAD_DIM + j] = PREV_GAIN * scale
        block.q_proj.weight.copy_(q)
        block.k_proj.weight.copy_(k)
        block.v_proj.weight.copy_(v)
        block.o_proj.weight.copy_(o)
        for p in (block.gate_proj, block.up_proj, block.down_proj):
            p.weight.zero_()

    @torch.inference_mode()
    def forward(self, ids: list[int], *, capture: list[int] | None = None,
                cache: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux [seq, 3, H], final [seq, H] post-norm, logits [seq, V]) for one prompt; aux: the inputs of the layers
        `capture` (SGLang's layers_to_capture; default [2, N//2, N-3]). With `cache` (one dict per layer, empty
        at first), `ids` continue the positions cached so far and the cache grows: decoding token by token."""
        seen = cache[0]["k"].shape[1] if cache and cache[0] else 0
        if not ids or seen + len(ids) > CONTEXT:
            raise ValueError(f"prompt length {seen + len(ids)} outside 1..{CONTEXT}")
        x = self.embed_tokens(torch.tensor(ids, dtype=torch.long))
        tables = rope_tables(torch.arange(seen, seen + len(ids)))
        wanted, aux = capture or aux_layer_ids(), {}
        for i, block in enumerate(self.layers):
            if i in wanted:
                aux[i] = x
            x = block(x, tables, None if cache is None else cache[i])
        final = rms_norm(x, self.norm)
        return torch.stack([aux[i] for i in wanted], dim=1), final, self.lm_head(final)

    def config(self) -> dict:
        """The Hugging Face config.json of this target."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
                "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": RMS_EPS,
                "rope_theta": ROPE_THETA, "rope_scaling": None, "max_position_embeddings": CONTEXT,
                "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
                "eos_token_id": IM_END_ID}


def export_target(directory: Path) -> Path:
    """Write the toy target as an HF directory holding what the trainer reads (embedding, norm, head) and what
    `eagle3 prepare` reads (its tokenizer and chat template)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    m = ToyLM()
    tensors = {"model.embed_tokens.weight": m.embed_tokens.weight, "model.norm.weight": m.norm,
               "lm_head.weight": m.lm_head.weight}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    honour_umask(directory / "model.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in tensors}}, indent=1))
    (directory / "config.json").write_text(json.dumps(m.config(), indent=1))
    write_tokenizer(directory)
    return directory
