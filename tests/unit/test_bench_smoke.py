"""`make bench` is not in the suite (it takes about 20 minutes); these keep its modules in step with the product.

The status-path benchmark once kept the store's dict API after issue 36 typed it, and `make bench` stopped
at its second section. Each module is imported here, and the status path's store is built and read at a
size that takes a second.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import bench

pytestmark = pytest.mark.timeout(60)


def test_every_bench_module_imports():
    names = [m.name for m in pkgutil.iter_modules([str(Path(bench.__file__).parent)])]
    assert "status_path" in names and "diagnosis_bench" in names, names
    for name in names:
        importlib.import_module(f"bench.{name}")


def test_the_status_paths_store_is_built_and_read(tmp_path):
    from bench import status_path

    ctl, store = status_path._open(str(tmp_path), 30)
    try:
        status = ctl.status()
        assert [store.verdict(stage).verdict for stage in ("server", "extract", "train")] == ["done"] * 3
        assert status is not None
    finally:
        ctl.close()
        store.close()


def test_the_topk_cost_benchs_answers_parse_through_the_clients_path(tmp_path, monkeypatch):
    """bench/topk_cost.py at a small width: its answers go through store_answer as the real ones would."""
    from bench import topk_cost

    monkeypatch.setattr(topk_cost, "H", 64)
    r = topk_cost.measure(rounds=1)
    assert r[256]["answer_mb"] > r[20]["answer_mb"] and r[20]["cpu_s"] > 0
