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


def measure(n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace(config=parse_config("", name="eagle3.toml"), path=Path(tmp) / "eagle3.toml")
        store = Store(ws.store_path)
        _fill(store, n)
        ctl = Controller(workspace=ws, store=store)
        ctl.status()
        times = timed(ctl.status, repeat=300)
        latest = timed(lambda: store.latest_observation(random.choice(["server", "extract", "train"])), repeat=300)
        ctl.close()
        return {"n": n, "p50_ms": percentile(times, 50) * 1e3, "p99_ms": percentile(times, 99) * 1e3,
                "latest_p99_ms": percentile(latest, 99) * 1e3}


def run(*, full: bool = True) -> list[str]:
    small, big = measure(1000), measure(1_000_000 if full else 100_000)
    lines = ["## Status path (issue 3)", "",
             "`Controller.status()` (store reads, stage verification; no probe, no NVML, no network), 300 calls each, "
             "same run.", "",
             "| observations | status p50 | status p99 | latest observation p99 | target |", "|---|---|---|---|---|"]
    for r in (small, big):
        lines.append(f"| {r['n']:,} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | {r['latest_p99_ms']:.3f} ms | p99 ≤ 50 ms |")
    lines += ["", f"p99 at {big['n']:,} is {big['p99_ms'] / small['p99_ms']:.2f}× the p99 at 1,000 (target: within 1.2×).", ""]
    return lines
