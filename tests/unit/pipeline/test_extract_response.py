"""Parsing and validating SGLang answers (pure)."""

import math

import pytest

from pipeline.errors import UserError
from pipeline.extract.preflight import plan
from pipeline.extract.response import BadResponse, check_rows, prefill_rows, topk_rows


def test_decode_rows_are_dropped_before_counting():
    rows = [[0.0] * 8 for _ in range(5)]
    meta = {"hidden_states": [rows, [1.0] * 8, [2.0] * 8]}
    assert prefill_rows(meta) == rows
    assert check_rows(prefill_rows(meta), seq=5, layers=4, width=None, chunk=None) == 8


def test_single_row_prefill():
    assert prefill_rows({"hidden_states": [[0.5] * 8]}) == [[0.5] * 8]


@pytest.mark.parametrize("meta", [{}, {"hidden_states": []}, {"hidden_states": "x"}, {"hidden_states": [["a"]]}])
def test_missing_hidden_states(meta):
    with pytest.raises(BadResponse):
        prefill_rows(meta)


def test_chunked_prefill_truncation_is_recognised_and_not_retryable():
    with pytest.raises(BadResponse) as err:
        check_rows([[0.0] * 8] * 100, seq=8292, layers=4, width=None, chunk=8192)
    assert not err.value.retry and "--chunked-prefill-size ≥ 8292 (now 8192)" in err.value.reason


def test_other_row_mismatch_is_retryable():
    with pytest.raises(BadResponse) as err:
        check_rows([[0.0] * 8] * 4, seq=5, layers=4, width=None, chunk=8192)
    assert err.value.retry


def test_width_change_and_non_finite_rejected():
    with pytest.raises(BadResponse, match="differs from the run's"):
        check_rows([[0.0] * 12], seq=1, layers=4, width=8, chunk=None)
    with pytest.raises(BadResponse, match="non-finite"):
        check_rows([[0.0, math.nan, 0.0, 0.0]], seq=1, layers=4, width=None, chunk=None)
    with pytest.raises(BadResponse, match="not a multiple"):
        check_rows([[0.0] * 7], seq=1, layers=4, width=None, chunk=None)


def test_topk_rows_shift_by_one_position():
    inp = [None, [[-0.1, 7, None], [-2.0, 8, None]], [[-0.2, 9, None], [-3.0, 1, None]]]
    out = [[[-0.3, 4, None], [-1.0, 5, None]]]
    ids, lps = topk_rows({"input_top_logprobs": inp, "output_top_logprobs": out}, seq=3, k=2)
    assert ids == [[7, 8], [9, 1], [4, 5]] and lps[2] == [-0.3, -1.0]


def test_preflight_refusals_and_warnings():
    with pytest.raises(UserError) as err:
        plan({}, layers=None, topk=None, longest=10)
    assert "--enable-return-hidden-states" in str(err.value) and "only the final layer" in str(err.value)
    p = plan({"enable_return_hidden_states": True, "enable_return_aux_hidden_states": True,
              "chunked_prefill_size": 100}, layers=None, topk=None, longest=500)
    assert (p.layers, p.final_present, p.topk) == (3, False, 256)
    assert any("radix cache" in w for w in p.warnings) and any("below the longest" in w for w in p.warnings)
    p = plan({"enable_return_hidden_states": True, "hidden_states_layers": 4, "disable_radix_cache": True},
             layers=None, topk=None, longest=10)
    assert (p.layers, p.final_present, p.topk, p.warnings) == (4, True, 0, [])
