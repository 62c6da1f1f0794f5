"""The handoff's rules that need no process: a handoff belongs to its run; training beside the server."""

from __future__ import annotations

import os

import psutil
import pytest

from pipeline.config import Workspace, parse_config
from pipeline.controller import Controller, ServerHoldsGpusError
from pipeline.handoff import completion
from pipeline.handoff.machine import Handoff, handoff_state
from pipeline.store import Store

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ctl(tmp_path):
    text = "[stages.server]\nargv = [\"x\"]\ngpus = [0, 1, 2, 3]\n[stages.train]\nargv = [\"y\"]\ngpus = [2, 3]\n"
    c = Controller(workspace=Workspace(config=parse_config(text, name="t.toml"), path=tmp_path / "t.toml"))
    yield c
    c.close()


def test_a_new_run_starts_with_auto_start_off(ctl):
    store = ctl.store
    first = store.open_run()
    assert ctl.autostart(True)["changed"]
    assert handoff_state(store)["run"] == first
    store.close_run(first, reason="all stages stopped")
    assert handoff_state(store)["step"] == "armed", "with no run open, the last run's handoff still shows"
    store.open_run()
    assert handoff_state(store) is None and ctl.status(sample_if_unmonitored=False).autostart == "off"
    again = ctl.autostart(True)
    assert again["changed"] and again["state"]["run"] == store.current_run()


def test_autostart_configured_arms_each_new_run(tmp_path):
    ws = Workspace(config=parse_config("[handoff]\nautostart = true\n", name="t.toml"), path=tmp_path / "t.toml")
    store = Store(ws.store_path)
    try:
        h = Handoff(ws=ws, store=store, supervisor=None)
        h.tick()
        assert handoff_state(store) is None, "no run: nothing to arm"
        store.open_run()
        h._arm_new_run()
        assert handoff_state(store)["step"] == "armed" and "config" in handoff_state(store)["reason"]
    finally:
        store.close()


def test_training_beside_a_server_holding_its_gpus_is_refused(ctl, monkeypatch):
    monkeypatch.setattr(completion, "check", lambda *a, **k: completion.Completion(complete=True, done=1, failed=0,
                                                                                   total=1))
    monkeypatch.setattr(ctl.supervisor, "start", lambda stage: {"pid": 1, "stage": stage})
    store = ctl.store
    store.insert_proc({"run_id": store.open_run(), "stage": "server", "state": "running", "pid": os.getpid(),
                       "pgid": os.getpid(), "create_time": psutil.Process().create_time(), "argv": "[]",
                       "started_at": 0, "stop_requested": 0})
    with pytest.raises(ServerHoldsGpusError, match=rf"server \(pid {os.getpid()}\) is running and holds GPU 2, 3"):
        ctl.start("train")
    assert ctl.start("train", force=True)["pid"] == 1
    audit = [(a["action"], a["outcome"]) for a in store.db["audit"].rows]
    assert audit == [("start train", "refused"), ("start train --force", "allowed")]


def test_a_stopped_stage_does_not_show_its_last_running_verdict(ctl):
    store = ctl.store
    run = store.open_run()
    proc_id = store.insert_proc({"run_id": run, "stage": "extract", "state": "stopped", "pid": None,
                                 "argv": "[]", "started_at": 0, "ended_at": 10, "stop_requested": 1,
                                 "reason": "exit code 0"})
    store.put("verdict:extract", {"proc_id": proc_id, "verdict": "progressing", "eta_s": 100.0, "reasons": ["x"],
                                  "t": 5})
    st = ctl.status(sample_if_unmonitored=False).to_json()["stages"]["extract"]
    assert st["verdict"] == "stopped" and st["eta_s"] is None
    assert st["reasons"] == ["stopped on request (exit code 0)"]


def test_a_launch_checked_against_a_cancel_in_its_own_transaction_starts_nothing(ctl):
    """The handoff decides to launch, a cancel commits, then the launch inserts its row: the check in
    the insert's transaction sees the cancel, so no training row (and no runner) appears after it."""
    before = ctl.store.latest_proc("train")
    assert ctl.supervisor.start("train", only_if=lambda: False) is None
    assert ctl.store.latest_proc("train") == before
