"""A tiny causal LM standing in for the target model (CPU, fixed seed).

Small blocks on a residual stream dominated by the token embedding make the next
token mostly a function of the current one, and a scaled LM head makes that
distribution peaked (low entropy): a draft head can learn it in a few steps, which
is what the demo and the training tests need. Auxiliary hidden states follow
SGLang's EAGLE-3 convention: the *input* of layers [2, N//2, N-3].
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
HIDDEN = 64
LAYERS = 8
HEADS = 4
CONTEXT = 2048
SEED = 1234
LOGIT_SCALE = 8.0


def aux_layer_ids(n_layers: int = LAYERS) -> list[int]:
    """SGLang's default EAGLE-3 capture: inputs of layers [2, N//2, N-3]."""
    return [2, n_layers // 2, n_layers - 3]


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ToyLM(nn.Module):
    """The toy target: embeddings, LAYERS blocks, final norm, LM head."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(SEED)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(CONTEXT, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
            self.pos.weight.copy_(torch.randn(CONTEXT, HIDDEN, generator=gen) * 0.05)
            self.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) * LOGIT_SCALE / HIDDEN**0.5)
        self.eval()

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux [seq, 3, H], final [seq, H] post-norm, logits [seq, V]) for one prompt."""
        if not ids or len(ids) > CONTEXT:
            raise ValueError(f"prompt length {len(ids)} outside 1..{CONTEXT}")
        t = torch.tensor(ids, dtype=torch.long)
        x = (self.embed(t) + self.pos(torch.arange(len(ids))))[None]
        mask = torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), diagonal=1)
        wanted, aux = aux_layer_ids(), {}
        for i, block in enumerate(self.blocks):
            if i in wanted:
                aux[i] = x[0]
            x = block(x, mask)
        final = self.norm(x[0])
        return torch.stack([aux[i] for i in wanted], dim=1), final, self.lm_head(final)
