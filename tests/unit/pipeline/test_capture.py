"""Aux-layer ids as SGLang's capture code maps them, for Llama- and DeepSeek/Kimi-family targets (issue 32)."""

from __future__ import annotations

import pytest

from pipeline.draft.capture import LAYER_INPUTS, SERVER_IDS, captured_layers, draft_ids, family

pytestmark = pytest.mark.timeout(30)


def test_llama_family_adds_one_and_defaults_to_2_half_and_n_minus_3():
    assert family("llama") == "llama" and family(None) == "llama"
    assert captured_layers([0, 2, 5], 8, model_type="llama") == [1, 3, 6]
    assert captured_layers(None, 32, model_type="llama") == captured_layers([], 32) == [2, 16, 29]


def test_deepseek_family_adds_one_only_when_the_first_id_is_1():
    # deepseek_v2.py: `if layer_ids and layer_ids[0] == 1: +1 else as given`; kimi_k25.py delegates to it
    for model_type in ("deepseek_v3", "kimi_k2", "kimi_k25"):
        assert family(model_type) == "deepseek"
        assert captured_layers([1, 29, 57], 61, model_type=model_type) == [2, 30, 58]  # SpecForge's DeepSeek-V3 ids
        assert captured_layers([2, 30, 58], 61, model_type=model_type) == [2, 30, 58]  # SpecForge's Kimi-K2.5 ids
        assert captured_layers(None, 61, model_type=model_type) == [2, 30, 58]


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", "kimi_k25"])
@pytest.mark.parametrize("ids", [[1, 29, 57], [2, 30, 58], [0, 10, 20], None])
def test_the_draft_is_fed_what_extraction_captured(model_type, ids):
    """The server's ids, carried verbatim into eagle_config, capture the same layers at serving as at extraction."""
    written = draft_ids(ids, SERVER_IDS, 61, model="/models/target")
    assert captured_layers(written or None, 61, model_type=model_type) == captured_layers(ids, 61, model_type=model_type)


def test_older_manifests():
    # the toy server reported layer inputs: its default means "none", others are ids + 1
    assert draft_ids([2, 4, 5], LAYER_INPUTS, 8, model="toy-lm") == []
    assert draft_ids([1, 3, 6], LAYER_INPUTS, 8, model="toy-lm") == [0, 2, 5]
    # a real SGLang reported the ids it was given, mislabelled as layer inputs: they are taken as given
    assert draft_ids([1, 29, 57], LAYER_INPUTS, 61, model="/models/DeepSeek-V3") == [1, 29, 57]
