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


def test_a_restarted_service_does_not_judge_a_finished_stage_again(tmp_path):
    """Training finished and judged `done` (its final verdict stored); the config then changes (another tool's
    progress source, whose total is unknown) and the service restarts: the finished stage is not judged again under
    the new settings — no verdict event, so no false "train is dead" page — and status keeps its verdict."""
    text = '[stages.train]\nout = "ckpt"\nargv = ["x"]\n[monitor]\nfake_gpus = 1\n'
    ws = Workspace(config=parse_config(text, name="eagle3.toml"), path=tmp_path / "eagle3.toml")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "progress.jsonl").write_text(json.dumps({"step": 60, "total_steps": 60}) + "\n")
    store = Store(ws.store_path)
    run = store.open_run()
    store.insert_proc({"run_id": run, "stage": "train", "state": "exited", "exit_code": 0, "pid": None,
                       "argv": json.dumps(["x"]), "started_at": 1.0, "ended_at": 2.0, "stop_requested": 0})
    first = Sampler(ws=ws, store=store)
    try:
        (_, verdict), = first.tick().values()
    finally:
        first.close()
    assert verdict.verdict == "done" and store.verdict("train").final
    events = len(store.events(kind="verdict"))
    changed = text.replace('out = "ckpt"', 'out = "ckpt"\nprogress = "files"\ndone_when = "exit0-and-total"')
    ws2 = Workspace(config=parse_config(changed, name="eagle3.toml"), path=tmp_path / "eagle3.toml")
    again = Sampler(ws=ws2, store=store)
    try:
        assert again.tick() == {}
    finally:
        again.close()
    assert len(store.events(kind="verdict")) == events and store.verdict("train").verdict == "done"
    store.close()


def test_a_config_edited_while_serve_runs_is_used_as_the_cli_uses_it_and_said_once(tmp_path):
    """serve follows the file: an edit that loads is used from the next tick (said once in the channel); one that
    does not load keeps the settings serve had, said once, with the error in status until the file is fixed."""
    import os

    from pipeline.config import load_workspace
    from pipeline.monitor import Monitor

    cfg = tmp_path / "eagle3.toml"
    original = '[stages.extract]\nargv = ["x"]\n[monitor]\nfake_gpus = 1\n'
    cfg.write_text(original)
    ws = load_workspace(cfg)
    store = Store(ws.store_path)
    monitor = Monitor(ws=ws)
    try:
        assert not monitor.check_config(store) and not store.events(kind="config-changed")
        cfg.write_text(original.replace('["x"]', '["y", "--new"]'))
        os.utime(cfg, ns=(1, 1))
        assert monitor.check_config(store) and monitor.ws.stage("extract").argv == ["y", "--new"]
        assert not monitor.check_config(store)
        (used,) = store.events(kind="config-changed")
        assert used["data"]["error"] is None and store.get("config_changed") is None
        cfg.write_text(original + "[stages.train]\nargv = [1]\n")
        os.utime(cfg, ns=(2, 2))
        assert not monitor.check_config(store) and monitor.ws.stage("extract").argv == ["y", "--new"]
        monitor.check_config(store)
        bad = store.events(kind="config-changed")[1:]
        assert len(bad) == 1 and "stages.train.argv" in bad[0]["data"]["error"] and store.get("config_changed")
        cfg.write_text(original)
        os.utime(cfg, ns=(3, 3))
        assert monitor.check_config(store) and monitor.ws.stage("extract").argv == ["x"]
        assert store.get("config_changed") is None
    finally:
        store.close()
