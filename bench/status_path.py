"""Status path: building `eagle3 status` from the store at 1,000 and 1,000,000 observations."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from bench.common import percentile, timed
from pipeline.config import Workspace, parse_config
from pipeline.controller import Controller
from pipeline.simtrace import Scenario, simulate
from pipeline.store import Store


def _fill(store: Store, n: int) -> None:
    template = simulate(Scenario("bench", samples=200)).observations
    rows = []
    for i in range(n):
        obs = dict(template[i % len(template)], t=1_790_000_000.0 + i * 10 / 3, stage=("server", "extract", "train")[i % 3])
        rows.append((obs["t"], obs["stage"], "r1", json.dumps(obs)))
        if len(rows) == 50_000:
            store.db.conn.executemany("INSERT INTO observations (t, stage, run_id, data) VALUES (?, ?, ?, ?)", rows)
            rows = []
    if rows:
        store.db.conn.executemany("INSERT INTO observations (t, stage, run_id, data) VALUES (?, ?, ?, ?)", rows)
    for stage in ("server", "extract", "train"):
        pid = store.insert_proc({"run_id": "r1", "stage": stage, "state": "exited", "pid": 1, "pgid": 1,
                                 "create_time": 1.0, "started_at": 1.0, "ended_at": 2.0, "exit_code": 0,
                                 "argv": "[]", "log": "x", "stop_requested": 0})
        store.put(f"verdict:{stage}", {"verdict": "done", "proc_id": pid, "final": True, "progress_pct": 100.0,
                                       "reasons": ["exited 0"], "t": 2.0})
    store.put("monitor", {"t": 1e12})


def _open(tmp: str, n: int) -> tuple[Controller, Store]:
    ws = Workspace(config=parse_config("", name="eagle3.toml"), path=Path(tmp) / "eagle3.toml")
    store = Store(ws.store_path)
    _fill(store, n)
    return Controller(workspace=ws, store=store), store


def run(*, full: bool = True) -> list[str]:
    """Both stores open at once; calls alternate between them so drift hits both alike."""
    big_n = 1_000_000 if full else 100_000
    with tempfile.TemporaryDirectory() as t1, tempfile.TemporaryDirectory() as t2:
        (small, s_store), (big, b_store) = _open(t1, 1000), _open(t2, big_n)
        times: dict[int, list[float]] = {1000: [], big_n: []}
        latest: dict[int, list[float]] = {1000: [], big_n: []}
        for _ in range(1000):
            for n, ctl, store in ((1000, small, s_store), (big_n, big, b_store)):
                times[n] += timed(ctl.status)
                latest[n] += timed(lambda st=store: st.latest_observation(random.choice(["server", "extract", "train"])))
        small.close()
        big.close()
    lines = ["## Status path (issue 3)", "",
             "`Controller.status()` (store reads and stage verification; no probe, no NVML, no network), 1,000 calls "
             "on each store, alternating between the two stores in one run.", "",
             "| observations | status p50 | status p99 | latest observation p99 | target |", "|---|---|---|---|---|"]
    for n in (1000, big_n):
        lines.append(f"| {n:,} | {percentile(times[n], 50) * 1e3:.2f} ms | {percentile(times[n], 99) * 1e3:.2f} ms | "
                     f"{percentile(latest[n], 99) * 1e3:.3f} ms | p99 ≤ 50 ms |")
    ratio = percentile(times[big_n], 99) / percentile(times[1000], 99)
    lines += ["", f"p99 at {big_n:,} is {ratio:.2f}× the p99 at 1,000 (target: within 1.2×). The status path reads the "
              "latest verdict and process rows only; the observation table's size does not enter it.", ""]
    return lines
