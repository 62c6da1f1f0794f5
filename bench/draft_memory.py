"""Computed (not measured) size of the EAGLE-3 draft and its training memory at a given shape.

`python bench/draft_memory.py` prints the README's table for H = 7,168 (Kimi-K2.5 /
DeepSeek-V3 shape: 56 heads, 8 KV heads, head_dim 128, MLP 40,960 as in SpecForge's
deepseek-v3 EAGLE-3 config), a draft vocabulary of 32,000 and a target vocabulary of 163,840.
"""

from __future__ import annotations

import argparse


def parts(H: int, heads: int, kv: int, head_dim: int, inter: int, draft_vocab: int, vocab: int) -> dict[str, int]:
    return {"fc 3H → H": 3 * H * H, "q_proj 2H → heads·head_dim": 2 * H * heads * head_dim,
            "k_proj + v_proj 2H → 2·kv·head_dim": 2 * 2 * H * kv * head_dim, "o_proj": heads * head_dim * H,
            "MLP gate/up/down (3·H·I)": 3 * H * inter, "norms (4·H)": 4 * H, "lm_head Vd·H": draft_vocab * H,
            "frozen: target embedding V·H": vocab * H, "frozen: target LM head V·H (forms the target)": vocab * H}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=40960)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--ttt", type=int, default=7)
    a = p.parse_args()
    rows = parts(a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.draft_vocab, a.vocab)
    trainable = sum(v for k, v in rows.items() if not k.startswith("frozen"))
    frozen = sum(v for k, v in rows.items() if k.startswith("frozen"))
    print("| part | parameters |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v / 1e6:,.1f} M |")
    print(f"| **trainable** | **{trainable / 1e9:.2f} B** |")
    print(f"\nper GPU (DDP replica): fp32 weights + grads + AdamW moments = 16 B × {trainable / 1e9:.2f} B = "
          f"{16 * trainable / 1e9:.1f} GB; frozen target tensors in fp32 {4 * frozen / 1e9:.1f} GB")
    for tokens in (1024, 2048, 4096):
        target = tokens * a.vocab * 4  # target logits over the full vocabulary, once per batch
        vocab_acts = 3 * a.ttt * tokens * a.draft_vocab * 4  # logits, log-softmax, grad per unrolled step
        mlp_acts = 4 * a.ttt * tokens * a.intermediate * 4  # gate, up, silu, product per step
        print(f"token budget {tokens:>5}: activations ≈ {(target + vocab_acts + mlp_acts) / 1e9:.1f} GB "
              f"(target logits {target / 1e9:.1f}, draft-vocabulary tensors {vocab_acts / 1e9:.1f}, "
              f"MLP {mlp_acts / 1e9:.1f})")


if __name__ == "__main__":
    main()
