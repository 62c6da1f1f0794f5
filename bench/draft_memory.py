"""Computed (not measured) size of the EAGLE-3 draft and its training memory at a given shape.

`python bench/draft_memory.py --preset kimi-k2.5|llama-3.1-8b` prints the README's tables: the
draft's parts, and the memory per GPU by token budget at `--max-length` (default 2048), with the
largest budget that fits 85 % of an 80 or 96 GB GPU. Kimi-K2.5 gets the shape the trainer picks for
an MLA target (56 heads × 128, 8 KV heads, MLP 40,960: SpecForge's DeepSeek-V3 EAGLE-3 config);
Llama-3.1-8B its own (32 heads × 128, 8 KV heads, MLP 14,336). Computed, not measured.
"""

from __future__ import annotations

import argparse


def parts(H: int, heads: int, kv: int, head_dim: int, inter: int, draft_vocab: int, vocab: int) -> dict[str, int]:
    return {"fc 3H → H": 3 * H * H, "q_proj 2H → heads·head_dim": 2 * H * heads * head_dim,
            "k_proj + v_proj 2H → 2·kv·head_dim": 2 * 2 * H * kv * head_dim, "o_proj": heads * head_dim * H,
            "MLP gate/up/down (3·H·I)": 3 * H * inter, "norms (4·H)": 4 * H, "lm_head Vd·H": draft_vocab * H,
            "frozen: target embedding V·H": vocab * H, "frozen: target LM head V·H (forms the target)": vocab * H}


PRESETS = {  # the draft shapes the trainer picks by default (pipeline/train/loop.py: draft_shape)
    "kimi-k2.5": dict(hidden=7168, heads=56, kv_heads=8, head_dim=128, intermediate=40960, vocab=163840),
    "llama-3.1-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
}
BUDGETS = (1024, 2048, 4096, 8192, 16384)
HEADROOM = 0.85  # of the GPU's memory: the CUDA context, the allocator's fragmentation, NCCL buffers


def per_gpu_gb(a, tokens: int, max_length: int) -> dict[str, float]:
    """Computed bytes per GPU, by part, at a token budget and a longest sample."""
    rows = parts(a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.draft_vocab, a.vocab)
    trainable = sum(v for k, v in rows.items() if not k.startswith("frozen"))
    frozen = sum(v for k, v in rows.items() if k.startswith("frozen"))
    return {"weights, grads, AdamW (fp32)": 16 * trainable / 1e9, "frozen embedding + head (bf16)": 2 * frozen / 1e9,
            # the target over the draft vocabulary (p, float32) for the whole step, and one chunk of the
            # full-vocabulary argmax (bf16) while it is formed
            "target (p over the draft vocabulary)": (tokens * a.draft_vocab * 4 + tokens * 16384 * 2) / 1e9,
            # each step's logits kept in bf16 for the soft cross-entropy's backward, and its float32 working copy
            "draft-vocabulary logits": (a.ttt * tokens * a.draft_vocab * 2 + 2 * tokens * a.draft_vocab * 4) / 1e9,
            "MLP gate, up, silu, product": 4 * a.ttt * tokens * a.intermediate * 4 / 1e9,
            # flash attention keeps q, k, v, the output and the log-sum-exp per step (linear in T; no T×T
            # matrix), plus the stacked diagonal keys and values of the steps before
            "attention (q, k, v, out; linear in T)": (a.ttt * tokens * (2 * a.heads + 2 * a.kv_heads) * a.head_dim * 4
                                                      + a.ttt * a.ttt / 2 * tokens * 2 * a.kv_heads * a.head_dim * 4)
            / 1e9,
            "hidden-size tensors (≈12 per step)": 12 * a.ttt * tokens * a.hidden * 4 / 1e9}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", choices=sorted(PRESETS), default="kimi-k2.5")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--max-length", type=int, default=2048)
    a = p.parse_args()
    for k, v in PRESETS[a.preset].items():
        setattr(a, k, v)
    rows = parts(a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.draft_vocab, a.vocab)
    trainable = sum(v for k, v in rows.items() if not k.startswith("frozen"))
    print(f"{a.preset}: H {a.hidden}, {a.heads} heads × {a.head_dim}, {a.kv_heads} KV heads, MLP {a.intermediate}, "
          f"vocabulary {a.vocab}, draft vocabulary {a.draft_vocab}, --ttt {a.ttt}, --max-length {a.max_length}\n")
    print("| part | parameters |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v / 1e6:,.1f} M |")
    print(f"| **trainable** | **{trainable / 1e9:.2f} B** |\n")
    print("| token budget | " + " | ".join(per_gpu_gb(a, 1024, a.max_length)) + " | **total** |")
    print("|---" * 9 + "|")
    fits = {}
    for tokens in BUDGETS:
        gb = per_gpu_gb(a, tokens, a.max_length)
        total = sum(gb.values())
        print(f"| {tokens} | " + " | ".join(f"{v:.1f}" for v in gb.values()) + f" | **{total:.1f} GB** |")
        for gpu in (80, 96):
            if total <= HEADROOM * gpu and tokens >= a.max_length:
                fits[gpu] = tokens
    print()
    for gpu in (80, 96):
        budget = fits.get(gpu)
        print(f"{gpu} GB GPU: --token-budget {budget} --max-length {a.max_length}" if budget else
              f"{gpu} GB GPU: no budget ≥ --max-length {a.max_length} fits; lower --max-length")


if __name__ == "__main__":
    main()
