"""Samples keyed by their line's content: `Manifest.reconcile` and `apply` over a real sqlite manifest."""

from __future__ import annotations

import sqlite3

import pytest

from pipeline.extract.dataset import scan
from pipeline.manifest import Manifest

pytestmark = pytest.mark.timeout(30)


def _data(path, lines):
    path.write_text("".join(f'{{"input_ids": [{n}]}}\n' for n in lines))
    return scan(path)


def _record(m, data, idx, status="done", key=True):
    m.record(idx=idx, sample_id=None, status=status, tokens=1, nbytes=1, attempts=1, error=None, now=0.0,
             line_hash=data.keys[idx] if key else None)


def test_moves_follow_their_line_and_crossing_moves_do_not_clobber(tmp_path):
    a = _data(tmp_path / "a.jsonl", [10, 11, 12, 13])
    files = tmp_path / "files"
    files.mkdir()
    m = Manifest(tmp_path / "out")
    for i in range(4):
        _record(m, a, i)
        (files / f"{i}").write_text(str(10 + i))
    b = _data(tmp_path / "b.jsonl", [13, 12, 99, 10, 11])  # 13 and 10 swap places: each lands on the other's start
    plan = m.reconcile(b.keys, same_data=False)
    assert plan.kept == 0 and sorted(plan.moves) == [(0, 3), (1, 4), (2, 1), (3, 0)] and not plan.dropped
    assert "4 moved" in plan.describe() and "1 of 5 lines to do" in plan.describe()
    m.apply(plan, lambda i: files / f"{i}")
    assert {i: (files / f"{i}").read_text() for i in (0, 1, 3, 4)} == {0: "13", 1: "12", 3: "10", 4: "11"}
    assert not (files / "2").exists() and not list(files.glob(".*"))
    assert sorted(m.done()) == [0, 1, 3, 4]
    again = m.reconcile(b.keys, same_data=True)
    assert again.kept == 4 and not again.changes
    c = _data(tmp_path / "c.jsonl", [13, 12])  # lines gone from the end: their rows and files go too
    gone = m.reconcile(c.keys, same_data=False)
    assert gone.kept == 2 and sorted(gone.dropped) == [3, 4]
    m.apply(gone, lambda i: files / f"{i}")
    assert sorted(p.name for p in files.iterdir()) == ["0", "1"] and sorted(m.done()) == [0, 1]
    m.close()


def test_rows_from_before_line_hashes_count_only_for_the_same_file(tmp_path):
    a = _data(tmp_path / "a.jsonl", [1, 2, 3])
    m = Manifest(tmp_path / "out")
    for i in range(3):
        _record(m, a, i, key=False)
    other = m.reconcile(a.keys, same_data=False)
    assert other.kept == 0 and other.unmatched_legacy == 3 and "not matchable" in other.describe()
    same = m.reconcile(a.keys, same_data=True)
    assert same.kept == 3 and len(same.hashed_keys) == 3
    m.apply(same, lambda i: tmp_path / f"f{i}")
    conn = sqlite3.connect(tmp_path / "out" / "manifest.sqlite")
    assert [r[0] for r in conn.execute("SELECT line_hash FROM samples ORDER BY idx")] == list(a.keys)
    conn.close()
    m.close()


def test_a_failed_try_gives_way_to_the_same_lines_done_sample(tmp_path):
    a = _data(tmp_path / "a.jsonl", [5, 6])
    m = Manifest(tmp_path / "out")
    _record(m, a, 0)
    _record(m, a, 1, status="failed")
    (tmp_path / "f0").write_text("5")
    b = _data(tmp_path / "b.jsonl", [6, 5])
    plan = m.reconcile(b.keys, same_data=False)
    assert plan.moves == [(0, 1)] and plan.failed_dropped == [1]
    m.apply(plan, lambda i: tmp_path / f"f{i}")
    assert m.done() == {1} and (tmp_path / "f1").read_text() == "5"
    m.close()
