"""The trainer's defaults and the draft's shape for a target (issue 32), without training."""

from __future__ import annotations

import math

import pytest

from pipeline.errors import UserError
from pipeline.train.loop import _check_args, draft_shape, lr_factor, parser

pytestmark = pytest.mark.timeout(30)
ARGS = ["--data", "d", "--out", "o", "--steps", "1000"]
MLA = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512,
       "q_lora_rank": 1536, "qk_rope_head_dim": 64, "intermediate_size": 18432}


def args(*extra):
    a = parser().parse_args([*ARGS, *extra])
    _check_args(a)
    return a


def test_defaults_are_specforges():
    a = args()
    assert (a.lr, a.warmup_ratio, a.schedule, a.max_grad_norm, a.grad_accum, a.max_length) == \
        (1e-4, 0.015, "cosine", 0.5, 1, 2048)
    f = lr_factor(a)  # warm-up over ceil(0.015 · 1000) = 15 steps, then cosine to 0 at step 1000
    assert f(0) == pytest.approx(1 / 15) and f(14) == pytest.approx(1.0)
    assert f(15) == 1.0 and f(15 + 492) == pytest.approx(0.5 * (1 + math.cos(math.pi * 492 / 985)))
    assert 0 < f(999) < 1e-5  # the last step still moves
    constant = lr_factor(args("--schedule", "constant", "--warmup-ratio", "0"))
    assert constant(0) == 1.0 and constant(999) == 1.0
    assert args("--token-budget", "1024").max_length == 1024  # the default never exceeds the budget


@pytest.mark.parametrize("extra, says", [
    (["--max-length", "8192"], "--max-length 8192 is more than --token-budget 4096"),
    (["--grad-accum", "0"], "--grad-accum 0: must be at least 1"),
    (["--warmup-ratio", "1.5"], "--warmup-ratio 1.5: must be at least 0 and below 1"),
])
def test_bad_settings_are_refused_in_one_line(extra, says):
    with pytest.raises(UserError, match=says):
        args(*extra)


def test_mla_target_gets_specforges_deepseek_v3_draft_shape_and_flags_override_it():
    shape, why = draft_shape(args(), MLA, 7168)
    assert shape == {"num_attention_heads": 56, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 40960}
    assert why == "an MLA target: SpecForge's DeepSeek-V3 EAGLE-3 shape"
    shape, why = draft_shape(args("--heads", "32", "--kv-heads", "4", "--head-dim", "192", "--intermediate", "20000"),
                             MLA, 7168)
    assert shape == {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 192, "intermediate_size": 20000}
    assert why.endswith("(--heads, --kv-heads, --head-dim, --intermediate given)")


def test_a_kimi_target_gets_specforges_kimi_shape_which_loads_at_tp_16_where_deepseeks_does_not():
    """Issue 51: SpecForge's configs/kimi-k25-eagle3.json (64 heads × 128, 64 KV heads, MLP 18,432); SGLang's
    LlamaAttention splits the heads across TP ranks, so DeepSeek-V3's 56 heads refuse TP 16 (Kimi on 2×8 H100)."""
    from pipeline.draft.sglang import loads_at_tp, tp_summary

    kimi = {**MLA, "model_type": "kimi_k2"}
    shape, why = draft_shape(args(), kimi, 7168)
    assert shape == {"num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128, "intermediate_size": 18432}
    assert why == "a Kimi-K2 target: SpecForge's Kimi-K2.5 EAGLE-3 shape"
    assert tp_summary(shape) == ([1, 2, 4, 8, 16], [])
    deepseek = draft_shape(args(), {**MLA, "model_type": "deepseek_v3"}, 7168)[0]
    ok, refused = tp_summary(deepseek)
    assert ok == [1, 2, 4, 8] and refused == ["TP 16: 56 attention heads do not split across 16 ranks"]
    # KV heads fewer than the ranks are replicated when the ranks are a multiple of them (SGLang's rule)
    assert loads_at_tp({"num_attention_heads": 32, "num_key_value_heads": 8}, 16) is None
    assert "KV heads" in loads_at_tp({"num_attention_heads": 48, "num_key_value_heads": 6}, 8)


def test_an_integer_linear_rope_factor_is_written_as_a_float():
    from pipeline.draft import rope
    from pipeline.draft.sglang import config_problems

    out = rope.normalise({"rope_type": "linear", "factor": 4})
    assert out == {"rope_type": "linear", "factor": 4.0} and isinstance(out["factor"], float)
    bad = {"rope_scaling": {"rope_type": "linear", "factor": 4}}
    assert any("takes a float" in p for p in config_problems(bad))


def test_llama_target_shape_and_its_head_dim():
    llama = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    assert draft_shape(args(), llama, 4096)[0] == {"num_attention_heads": 32, "num_key_value_heads": 8,
                                                   "head_dim": 128, "intermediate_size": 14336}
    gemma_like = {**llama, "head_dim": 256}  # a head_dim other than hidden / heads is kept
    assert draft_shape(args(), gemma_like, 4096)[0]["head_dim"] == 256
    with pytest.raises(UserError, match="the heads must divide by the key/value heads"):
        draft_shape(args("--heads", "12"), llama, 4096)


def test_frozen_target_tensors_are_bf16_on_a_gpu_and_the_target_is_formed_from_them():
    import torch

    from pipeline.train.model import build_target, frozen_dtype

    assert frozen_dtype(torch.device("cuda", 0)) == torch.bfloat16 and frozen_dtype("cpu") == torch.float32

    class Vocab:  # what build_target reads of the draft: its vocabulary maps
        t2d = torch.ones(6, dtype=torch.bool)

        def hot_ids(self):
            return torch.arange(6)

    final = torch.randn(1, 3, 4)
    head = torch.randn(6, 4)
    batch = {"final": final, "mask": torch.ones(1, 3, dtype=torch.bool)}
    exact = build_target(batch, Vocab(), head)["p"]
    half = build_target(batch, Vocab(), head.to(torch.bfloat16))["p"]  # as on a GPU: no fp32 copy of the head
    assert half.dtype == torch.float32 and torch.allclose(half, exact, atol=0.05)


def test_nested_text_configs_and_prefixed_tensors(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from pipeline.train.target import load_target

    for key, prefix in (("language_config", "model.language_model."), ("text_config", "language_model.model.")):
        d = tmp_path / key
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True, key: {"hidden_size": 4, "vocab_size": 6}}))
        save_file({f"{prefix}embed_tokens.weight": torch.ones(6, 4), f"{prefix}norm.weight": torch.ones(4)},
                  d / "model.safetensors")
        t = load_target(str(d), need_norm=True)
        assert t.config["hidden_size"] == 4 and t.config["tie_word_embeddings"] is True
        assert t.head is t.embed and t.norm is not None  # tied: the embedding is the head
