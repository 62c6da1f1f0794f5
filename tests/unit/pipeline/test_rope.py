"""RoPE as SGLang 0.5.23's get_rope builds it for a Llama draft (issue 32): cos/sin against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.draft import rope

pytestmark = pytest.mark.timeout(60)
POSITIONS = torch.tensor([0, 5, 100, 1000])


def expected_tables(inv: list[float], positions=POSITIONS, *, mscale: float = 1.0, divide: float = 1.0):
    cos = [[math.cos(p / divide * f) * mscale for f in inv] * 2 for p in positions.tolist()]
    sin = [[math.sin(p / divide * f) * mscale for f in inv] * 2 for p in positions.tolist()]
    return torch.tensor(cos), torch.tensor(sin)


def check(r: rope.Rope, inv: list[float], **kw) -> None:
    cos, sin = r.tables(POSITIONS)
    want_cos, want_sin = expected_tables(inv, **kw)
    assert torch.allclose(cos, want_cos, atol=2e-5), (cos, want_cos)
    assert torch.allclose(sin, want_sin, atol=2e-5), (sin, want_sin)


def test_llama3_by_hand():
    """head_dim 8, θ 500: inverse frequencies 1, 0.21147, 0.044721, 0.0094574, wavelengths 6.28, 29.7, 140.5,
    664.4. llama3 {factor 8, original 32, low 1, high 4}: wavelengths under 32/4 = 8 kept, over 32/1 = 32 divided
    by 8, between blended: smooth = (32 / 29.711 − 1) / 3 = 0.025677 → (1 − s)·0.21147/8 + s·0.21147 = 0.031185."""
    scaling = rope.normalise({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32})
    check(rope.build(8, 500.0, scaling, 128), [1.0, 0.031185462, 0.044721360 / 8, 0.0094574161 / 8])


def test_yarn_by_hand_with_mscale():
    """head_dim 8, θ 10000, yarn {factor 4, original 64}: correction range over dims from
    8·ln(64/(32·2π))/(2·ln 10000) = −0.497 → 0 to 8·ln(64/2π)/(2·ln 10000) = 1.008 → 2; ramp [0, 0.5, 1, 1];
    inverse frequencies 1, 0.5·0.1/4 + 0.5·0.1 = 0.0625, 0.01/4, 0.001/4; cos and sin × (0.1·ln 4 + 1) = 1.138629."""
    scaling = rope.normalise({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    check(rope.build(8, 10000.0, scaling, 256), [1.0, 0.0625, 0.0025, 0.00025], mscale=1.1386294)
    # Kimi-K2's keys: mscale = mscale_all_dim = 1 → the ratio is 1; attn_factor multiplies it
    kimi = rope.normalise({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "attn_factor": 0.5})
    check(rope.build(8, 10000.0, kimi, 256), [1.0, 0.0625, 0.0025, 0.00025], mscale=0.5)


def test_linear_dynamic_and_default():
    base = [1.0, 0.1, 0.01, 0.001]  # θ 10000, head_dim 8
    check(rope.build(8, 10000.0, None, 64), base)
    check(rope.build(8, 10000.0, rope.normalise({"rope_type": "default"}), 64), base)
    check(rope.build(8, 10000.0, rope.normalise({"rope_type": "linear", "factor": 2.0}), 64), base, divide=2.0)
    # dynamic: SGLang's static cache at base θ·(f² − f + 1)^(d/(d−2)) = 10000 · 3^(4/3) for f = 2, d = 8
    b = 10000.0 * 3 ** (8 / 6)
    check(rope.build(8, 10000.0, rope.normalise({"rope_type": "dynamic", "factor": 2.0}), 64),
          [b ** (-i / 4) for i in range(4)])


@pytest.mark.parametrize("scaling, says", [
    ({"rope_type": "deepseek_yarn", "factor": 40}, "rope type 'deepseek_yarn' is not one the draft can be trained with"),
    ({"type": "longrope", "short_factor": [1.0]}, "rope type 'longrope'"),
    ({"factor": 2.0}, "rope type '(none given)'"),
    ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "multimodal (mrope)"),
    ({"rope_type": "dynamic", "factor": 2.0, "alpha": 1.0}, "dynamic NTK with alpha"),
    ({"rope_type": "linear", "factor": "two"}, "rope_scaling.factor: 'two' is not a number"),
    ("llama3", "is not an object"),
])
def test_other_types_are_refused_in_one_line(scaling, says):
    with pytest.raises(rope.RopeError) as err:
        rope.normalise(scaling)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_config_forms_sglang_reads():
    """transformers v5's rope_parameters first; a top-level original_max_position_embeddings joins the scaling."""
    theta, scaling = rope.from_config({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                           "original_max_position_embeddings": 8192}})
    assert theta == 500000.0 and scaling == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    theta, scaling = rope.from_config({"rope_theta": 50000.0, "original_max_position_embeddings": 4096,
                                       "rope_scaling": {"type": "yarn", "factor": 32.0}})
    assert theta == 50000.0 and scaling == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    assert rope.from_config({}) == (10000.0, None)
