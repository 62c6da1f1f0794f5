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
    assert f(15 + 492) == pytest.approx(0.5 * (1 + math.cos(math.pi * 493 / 985)))
    assert f(999) == pytest.approx(0.0, abs=1e-9)
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


def test_llama_target_shape_and_its_head_dim():
    llama = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    assert draft_shape(args(), llama, 4096)[0] == {"num_attention_heads": 32, "num_key_value_heads": 8,
                                                   "head_dim": 128, "intermediate_size": 14336}
    gemma_like = {**llama, "head_dim": 256}  # a head_dim other than hidden / heads is kept
    assert draft_shape(args(), gemma_like, 4096)[0]["head_dim"] == 256
    with pytest.raises(UserError, match="the heads must divide by the key/value heads"):
        draft_shape(args("--heads", "12"), llama, 4096)
