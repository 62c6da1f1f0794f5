"""The fast path reads the same floats as json.loads, bit for bit, and hands anything odd back to it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.extract.fastparse import split
from pipeline.extract.response import BadResponse, prefill_rows
from pipeline.extract.writer import tensors_for


def _answer(rows, *, decode=1, separators=(", ", ": "), extra=None):
    hs = [rows] + [[0.25] * len(rows[0]) for _ in range(decode)]
    meta = {"id": "x", "prompt_tokens": len(rows), "hidden_states": hs, **(extra or {})}
    return json.dumps({"text": "", "output_ids": [7], "meta_info": meta}, separators=separators).encode()


@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])  # Python's json and orjson/compact layouts
def test_bit_for_bit_what_json_loads_gives(separators):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3 * 64, generator=g) * torch.logspace(-20, 20, 3 * 64)  # tiny to huge magnitudes
    body = _answer(x.tolist(), separators=separators,
                   extra={"input_top_logprobs": [None] + [[[-0.5, 3, None]]] * 36, "output_top_logprobs": [[[-1, 2, None]]]})
    rest, rows = split(body)
    slow = prefill_rows(json.loads(body)["meta_info"])
    a = tensors_for(token_ids=list(range(37)), rows=rows, layers=3, dtype="bf16", topk=None)
    b = tensors_for(token_ids=list(range(37)), rows=slow, layers=3, dtype="bf16", topk=None)
    assert np.array_equal(a["hidden_states"].array, b["hidden_states"].array)
    assert np.array_equal(rows, np.array(slow, dtype=np.float32)) and rows.dtype == np.float32
    assert rest["meta_info"]["input_top_logprobs"][1] == [[-0.5, 3, None]] and rest["output_ids"] == [7]
    assert rest["meta_info"]["hidden_states"] == []


def test_a_long_answer_is_parsed_in_chunks(monkeypatch):
    import pipeline.extract.fastparse as fp

    monkeypatch.setattr(fp, "CHUNK_BYTES", 100)  # many chunks, boundaries anywhere
    x = torch.randn(50, 16)
    _, rows = split(_answer(x.tolist(), decode=0))
    assert np.array_equal(rows, x.numpy())


def test_a_single_row_prefill_flattened():
    body = json.dumps({"meta_info": {"hidden_states": [[0.5, 1.5, 2.5, 3.5]]}}).encode()
    _, rows = split(body)
    assert rows.shape == (1, 4) and rows.tolist() == [[0.5, 1.5, 2.5, 3.5]]


@pytest.mark.parametrize("body", [
    b'{"meta_info": {"hidden_states": [[[1.0, NaN], [2.0, 3.0]]]}}',  # Python's json writes NaN; simdjson refuses
    b'{"meta_info": {"id": 1}}',  # no hidden states
    b'{"meta_info": {"hidden_states": "x"}}',
    b'{"a": {"hidden_states": [[[1.0]]]}, "meta_info": {"hidden_states": [[[1.0]]]}}',  # the key twice
    b'{"meta_info": {"hidden_states": [[[1.0], [2.0]], [[3.0]]]}}',  # a nested decode entry
    b'{"meta_info": {"hidden_states": [[[1.0, "a"], [2.0, 3.0]]]}}',  # not all numbers
])
def test_other_layouts_go_back_to_json_loads(body):
    assert split(body) is None


def test_json_loads_path_names_a_row_that_is_not_numbers():
    from pipeline.extract.response import check_rows

    with pytest.raises(BadResponse, match="not all numbers"):
        check_rows([[1.0, "a"]], seq=1, layers=2, width=None, chunk=None)


@pytest.mark.parametrize("body, why", [
    (b'{"meta_info": {"hidden_states": [[[1.0, 2.0], [3.0]]]}}', "rows of different widths"),
    (b'{"meta_info": {"hidden_states": [[[1e300, 1.0]]]}}', "non-finite"),  # overflows float32
])
def test_unusable_rows_are_bad_answers(body, why):
    with pytest.raises(BadResponse, match=why):
        split(body)


def test_a_bytearray_is_parsed_in_place_and_left_as_it_was(monkeypatch):
    import pipeline.extract.fastparse as fp

    monkeypatch.setattr(fp, "CHUNK_BYTES", 64)
    x = torch.randn(20, 8)
    body = bytearray(_answer(x.tolist()))
    before = bytes(body)
    _, rows = split(body)
    assert np.array_equal(rows, x.numpy()) and bytes(body) == before


def test_rows_split_by_newlines_parse_and_a_row_followed_by_junk_goes_to_json_loads():
    """Rows are found one "]" at a time: any whitespace between them is read; anything else than "," and a row,
    or the matrix's "]", is not SGLang's layout."""
    body = b'{"meta_info": {"hidden_states": [[[1.5, 2.5],\n  [3.5, 4.5]\n], [0.25, 0.25]]}}'
    _, rows = split(body)
    assert rows.tolist() == [[1.5, 2.5], [3.5, 4.5]]
    assert split(b'{"meta_info": {"hidden_states": [[[1.5, 2.5] x [3.5, 4.5]]]}}') is None
    assert split(b'{"meta_info": {"hidden_states": [[[1.5, 2.5], 7]]}}') is None
