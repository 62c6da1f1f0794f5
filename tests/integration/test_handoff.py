"""The auto-start handoff, the train-now guard, the restart policy and reminders, with real processes."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import load_workspace
from pipeline.controller import Controller
from pipeline.handoff.machine import Handoff
from pipeline.observe.probes import known
from pipeline.stages.supervisor import Supervisor
from pipeline.store import Store
from tests.conftest import ROOT, eagle3, fixture_argv, status_json, wait_for

pytestmark = pytest.mark.timeout(240)


def demo_ws(tmp_path: Path, *, train_argv: list[str] | None = None, samples: int = 80) -> Path:
    """`init --demo`'s workspace (written in-process) with `samples` prompts instead of the demo's 300: the
    handoff is tested here, not the draft."""
    from pipeline.toy.demo_workspace import write_dataset, write_demo_workspace

    cfg = write_demo_workspace(tmp_path / "ws")
    write_dataset(cfg.parent / "data.jsonl", samples)
    # 10 steps of the real trainer: the handoff is tested here; the demo's own budget in test_demo
    text = re.sub(r'"--steps", "\d+"', '"--steps", "10"', cfg.read_text())
    if train_argv is not None:
        text = re.sub(r"(\[stages\.train\]\nargv = )\[.*?\]\n", lambda m: m.group(1) + json.dumps(train_argv) + "\n",
                      text, flags=re.S)
    cfg.write_text(text)
    return cfg


status = status_json


def train_rows(cfg: Path) -> list[dict]:
    conn = sqlite3.connect(cfg.parent / ".eagle3" / "state.sqlite")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM stage_procs WHERE stage = 'train'")]
    conn.close()
    return rows


def handoff_step(cfg: Path) -> str | None:
    """The handoff's step as the store holds it (a plain read: no CLI start per poll)."""
    conn = sqlite3.connect(f"file:{cfg.parent / '.eagle3' / 'state.sqlite'}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM kv WHERE key = 'handoff'").fetchone()
    finally:
        conn.close()
    return json.loads(row[0]).get("step") if row else None


def serve(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=60)[0]


def cleanup(cfg: Path) -> None:
    eagle3("stop", "--all", "--grace", "2", "--config", str(cfg))


@pytest.fixture
def completed_ws(tmp_path):
    """A demo workspace whose extraction has completed; training is a stand-in that sleeps."""
    cfg = demo_ws(tmp_path, train_argv=fixture_argv("sleeper.py"))
    assert eagle3("start", "server", "--config", str(cfg)).returncode == 0
    assert eagle3("start", "extract", "--config", str(cfg)).returncode == 0
    wait_for(lambda: status(cfg)["stages"]["extract"]["state"] == "exited", timeout=120, what="extraction", interval=1.0)
    yield cfg
    cleanup(cfg)


STEPS = ["armed", "waiting-for-completion", "stopping-server", "waiting-for-gpu-release", "launching-training"]


def test_service_death_at_each_step_resumes_and_launches_once(completed_ws):
    cfg = completed_ws
    cfg.write_text(cfg.read_text().replace("tick_s = 1\n", "tick_s = 0.3\n"))  # 7 restarts: short ticks
    ws = load_workspace(cfg)
    for i, step in enumerate(STEPS + ["launching-training+row", "launching-training+orphan"]):
        # The world as the dead service left it: the server still up before the stop step, stopped after it.
        server_up = Controller(workspace=ws).supervisor.is_running("server")
        if step in STEPS[:3] and not server_up:
            assert eagle3("start", "server", "--config", str(cfg)).returncode == 0
        elif step not in STEPS[:3] and server_up:
            assert eagle3("stop", "server", "--config", str(cfg)).returncode == 0
        store = Store(ws.store_path)
        before = len(train_rows(cfg))
        floor = max((r["id"] for r in train_rows(cfg)), default=0)
        state = {"step": step.split("+")[0], "reason": "the service died here", "armed_by": "test",
                 "train_floor": floor, "gpu_wait_since": time.time(), "server_stopped_at": time.time()}
        store.put("handoff", state)
        if step.endswith("+row"):  # died right after launching: the train row exists
            Supervisor(workspace=ws, store=store).start("train")
        if step.endswith("+orphan"):  # died between inserting the train row and spawning its runner, 11 s ago
            store.insert_proc({"run_id": store.current_run() or store.open_run(), "stage": "train",
                               "state": "running", "argv": "[]", "started_at": time.time() - 11,
                               "stop_requested": 0})
        store.close()
        svc = serve(cfg)
        # until the handoff launched training, then five ticks more: time enough to see a second launch
        wait_for(lambda svc=svc: handoff_step(cfg) == "training-running" or svc.poll() is not None, timeout=90,
                 what=f"step {step}: the restarted service to launch training", interval=0.2)
        time.sleep(5 * 0.3)
        out = finish(svc)
        assert svc.returncode == 0, out
        st = status(cfg)
        assert st["autostart"] == "training-running", (step, st["autostart_reason"], out)
        started = [r for r in train_rows(cfg)[before:] if r["pid"] is not None]
        assert len(started) == 1, f"step {step}: training must be launched exactly once"
        if step.endswith("+orphan"):
            assert train_rows(cfg)[before]["reason"].startswith("never started: no runner took it up")
        assert st["stages"]["server"]["state"] == "stopped"
        assert eagle3("stop", "train", "--grace", "2", "--config", str(cfg)).returncode == 0
        assert i < len(STEPS) + 2


def test_early_exit_0_never_hands_off(tmp_path):
    cfg = demo_ws(tmp_path, train_argv=fixture_argv("sleeper.py"))
    text = cfg.read_text()
    text = re.sub(r"(\[stages\.extract\]\nargv = )\[.*?\]\n", lambda m: m.group(1) + json.dumps(
        fixture_argv("fake_extract.py", str(cfg.parent / "out"), "100", "0", "40")) + "\n", text, flags=re.S)
    cfg.write_text(text)
    try:
        assert eagle3("start", "extract", "--config", str(cfg)).returncode == 0
        assert eagle3("autostart", "on", "--config", str(cfg)).returncode == 0
        wait_for(lambda: status(cfg)["stages"]["extract"]["state"] == "exited", what="early exit", interval=1.0)
        out = eagle3("serve", "--max-ticks", "4", "--config", str(cfg), timeout=60)
        st = status(cfg)
        assert st["autostart"] == "waiting-for-completion"
        assert "40 of 100 samples processed" in st["autostart_reason"], out.stdout
        assert train_rows(cfg) == []
        refused = eagle3("start", "train", "--config", str(cfg))
        assert refused.returncode == 2
        assert "extraction is 40.0 % done (40 / 100)" in refused.stderr
        assert "Auto-start is armed" in refused.stderr and "eagle3 autostart on" not in refused.stderr  # it is on
        forced = eagle3("start", "train", "--force", "--config", str(cfg))
        assert forced.returncode == 0, forced.stderr
        conn = sqlite3.connect(cfg.parent / ".eagle3" / "state.sqlite")
        audit = conn.execute("SELECT action, outcome FROM audit ORDER BY id").fetchall()
        conn.close()
        assert ("start train", "refused") in audit and ("start train --force", "allowed") in audit
        assert eagle3("autostart", "off", "--config", str(cfg)).stdout.startswith("auto-start cancelled")
    finally:
        cleanup(cfg)


class ScriptedGpus:
    """GPU readings that hold memory for `held_ticks` reads, then release it (None: never)."""

    def __init__(self, held_ticks: int | None) -> None:
        self.held_ticks, self.reads = held_ticks, 0

    def read(self, pid_stage=None):
        self.reads += 1
        held = self.held_ticks is None or self.reads <= self.held_ticks
        return known([{"index": i, "mem_used_mb": 70000.0 if held else 900.0} for i in range(2)])


@pytest.mark.parametrize("held_ticks", [3, None])
def test_gpu_release_waits_for_memory_and_times_out_without_launch(tmp_path, held_ticks):
    cfg = demo_ws(tmp_path, train_argv=fixture_argv("sleeper.py"))
    ws = load_workspace(cfg)
    store = Store(ws.store_path)
    store.put("gpu_baseline", {"0": 800.0, "1": 800.0})
    clock = {"t": 1000.0}
    sup = Supervisor(workspace=ws, store=store)
    h = Handoff(ws=ws, store=store, supervisor=sup, gpu_probe=ScriptedGpus(held_ticks), clock=lambda: clock["t"],
                port_check=lambda port: True)
    store.put("handoff", {"step": "waiting-for-gpu-release", "reason": "x", "gpu_wait_since": 1000.0})
    try:
        for _ in range(8):
            h.tick()
            clock["t"] += 20
        state = store.get("handoff")
        alerts = [e for e in store.events() if e["kind"] == "handoff-alert"]
        if held_ticks is None:
            assert state["step"] == "failed" and "GPUs not released" in state["reason"]
            assert "memory still held on GPU 0 (70000 MB)" in state["reason"]
            assert len(alerts) == 1 and not list(store.db["stage_procs"].rows_where("stage = 'train'"))
        else:
            assert state["step"] == "training-running" and not alerts
    finally:
        sup.stop_all(grace_s=2)
        store.close()


def test_double_arm_is_one_handoff_and_reminder_is_delivered(completed_ws):
    cfg = completed_ws
    first = eagle3("autostart", "on", "--config", str(cfg)).stdout
    second = eagle3("autostart", "on", "--config", str(cfg)).stdout
    assert first.startswith("auto-start armed") and "already armed" in second
    assert "no monitor is running" in eagle3("remind", "1s", "--config", str(cfg)).stdout
    time.sleep(1.2)
    out = eagle3("serve", "--max-ticks", "6", "--config", str(cfg), timeout=90).stdout
    assert "checking back as asked by cli:" in out and "extract: done 100.0 %" in out
    assert out.count("auto-start: *stopping-server*") == 1
    assert len(train_rows(cfg)) == 1
