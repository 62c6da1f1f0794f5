"""The sampler records an alert event when the run will not fit on disk (once)."""

import json
import sqlite3

from pipeline.config import Workspace, parse_config
from pipeline.manifest import SCHEMA
from pipeline.observe.sampler import Sampler
from pipeline.store import Store


def test_disk_will_not_fit_is_one_condition_event(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    conn = sqlite3.connect(out / "manifest.sqlite")
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("samples_total", "10"), ("tokens_total", str(10**13)),
                                                       ("layers", "4"), ("hidden_size", "7168")])
    conn.execute("INSERT INTO samples (idx, status, tokens) VALUES (0, 'done', 100)")
    conn.commit()
    conn.close()
    ws = Workspace(config=parse_config('[stages.extract]\nout = "out"\nargv = ["x"]\n[monitor]\nfake_gpus = 1\n',
                                       name="eagle3.toml"), path=tmp_path / "eagle3.toml")
    store = Store(ws.store_path)
    run = store.open_run()
    store.insert_proc({"run_id": run, "stage": "extract", "state": "running", "pid": None, "argv": json.dumps(["x"]),
                       "started_at": 1.0, "stop_requested": 0})
    sampler = Sampler(ws=ws, store=store)
    try:
        obs, _ = sampler.tick()["extract"]
        sampler.tick()
    finally:
        sampler.close()
    assert obs["disk"]["fits"] is False and obs["disk"]["need_bytes"] > obs["disk"]["free_bytes"]
    alerts = [e for e in store.events() if e["kind"] == "condition-alert"]
    assert len(alerts) == 1 and "will not fit on disk" in alerts[0]["data"]["reason"]
    store.close()
