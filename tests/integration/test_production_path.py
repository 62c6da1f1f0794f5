"""The operator guide's production path, as the service runs it: systemd's PATH (no venv on it),
`eagle3 init`'s template filled in, Socket Mode with Slack unreachable. The toy server stands in
for SGLang and a stand-in trainer for torchrun (the real torchrun handoff is test_demo's)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.configcheck import SERVICE_PATH
from pipeline.toy.demo_workspace import write_dataset
from tests.conftest import ROOT, status_json, wait_for

pytestmark = pytest.mark.timeout(300)
EAGLE3 = str(Path(sys.executable).parent / "eagle3")  # what the unit's ExecStart names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env() -> dict:
    """The unit's environment: systemd's PATH, the secrets from the env file, Slack unreachable."""
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3_CONFIG", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=SERVICE_PATH, SLACK_BOT_TOKEN="xoxb-prod-test", SLACK_APP_TOKEN="xapp-prod-test",
               SLACK_API_URL=f"http://127.0.0.1:{free_port()}/api/")  # nothing listens there
    return env


def eagle3(cfg: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EAGLE3, *args, "--config", str(cfg)], env=service_env(), cwd=cfg.parent,
                          capture_output=True, text=True, timeout=90)


status = status_json


def rows(cfg: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(cfg.parent / ".eagle3" / "state.sqlite", timeout=10)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def filled_template(tmp_path: Path, *, train_argv: list[str]) -> Path:
    """`eagle3 init`, then what the guide says to fill in (the toy server in place of SGLang)."""
    ws = tmp_path / "ws"
    assert subprocess.run([EAGLE3, "init", str(ws)], env=service_env(), capture_output=True).returncode == 0
    cfg = ws / "eagle3.toml"
    write_dataset(ws / "data.jsonl", 60)
    port = free_port()
    text = cfg.read_text().replace("30000", str(port))
    text = re.sub(r'(\[stages\.server\]\n(?:#[^\n]*\n)*)argv = \[.*?\]\n',
                  lambda m: m.group(1) + f'argv = ["{EAGLE3}", "toy-server", "--port", "{port}"]\n', text, flags=re.S)
    text = re.sub(r'(\[stages\.train\]\n(?:#[^\n]*\n)*)argv = \[.*?\]\n',
                  lambda m: m.group(1) + f"argv = {json.dumps(train_argv)}\n", text, flags=re.S)
    for old, new in {"<DATA_JSONL>": str(ws / "data.jsonl"), "<EXTRACT_OUT>": str(ws / "out"),
                     "<CKPT_DIR>": str(ws / "ckpt"), "<SLACK_CHANNEL_ID>": "C0PRODTEST", "<MODEL_PATH>": "unused",
                     '"--concurrency", "32"': '"--concurrency", "8", "--server-wait", "60"',
                     "tick_s = 10 ": "tick_s = 0.5", "[monitor]\n": "[monitor]\nfake_gpus = 8\n",
                     "server_stop_grace_s = 60": "server_stop_grace_s = 5",
                     "[handoff]\n": "[handoff]\nlaunch_backoff_s = 3\nsettle_s = 0.5\nverify_sample = 20\n"}.items():
        text = text.replace(old, new)
    cfg.write_text(text)
    return cfg


def start_serve(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen([EAGLE3, "serve", "--config", str(cfg)], env=service_env(), cwd=cfg.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def stop_serve(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=60)[0]


def test_the_guides_production_path(tmp_path):
    stand_in = [sys.executable, str(ROOT / "tests" / "fixtures" / "fake_train.py"), str(tmp_path / "ws" / "ckpt"), "5"]
    cfg = filled_template(tmp_path, train_argv=["torchrun", "--standalone", "-m", "pipeline.train"])
    checked = eagle3(cfg, "check-config")
    assert checked.returncode == 2 and '"torchrun" is not on the service\'s PATH' in checked.stderr, checked.stderr
    assert len(checked.stderr.strip().splitlines()) == 2, "the bare torchrun is the one problem left"
    serve = None
    try:
        for args in (["start", "server"], ["start", "extract"], ["autostart", "on"]):
            out = eagle3(cfg, *args)
            assert out.returncode == 0, (args, out.stdout, out.stderr)
        serve = start_serve(cfg)
        wait_for(lambda: status(cfg)["monitor"] == "running", timeout=30, interval=1.0, what="serve to start")
        second = eagle3(cfg, "serve")
        assert second.returncode == 2 and "another `eagle3 serve` (pid" in second.stderr, second.stderr

        # Training cannot start (torchrun is not on the service's PATH): bounded, then failed with the cause.
        wait_for(lambda: "launch attempt 1 of 3 failed" in (status(cfg)["autostart_reason"] or ""), timeout=150,
                 interval=1.0, what="the first failed launch")
        off = eagle3(cfg, "autostart", "off")
        assert off.returncode == 0 and off.stdout.startswith("auto-start cancelled"), off.stdout + off.stderr
        # The retry is due 3 s after the first failure; on a loaded machine it may land before the cancel.
        tried = len(rows(cfg, "SELECT id FROM stage_procs WHERE stage = 'train'"))
        assert tried in (1, 2)
        time.sleep(4)  # past the next retry's due time: a cancelled handoff must not take it
        assert len(rows(cfg, "SELECT id FROM stage_procs WHERE stage = 'train'")) == tried, "cancelled: no relaunch"
        assert eagle3(cfg, "autostart", "on").stdout.startswith("auto-start armed")
        st = wait_for(lambda: (s := status(cfg))["autostart"] == "failed" and s, timeout=60, interval=1.0,
                      what="the handoff to fail")
        assert "training could not be started after 3 attempt(s): cannot start 'torchrun': No such file" in (
            st["autostart_reason"]), st["autostart_reason"]
        assert len(rows(cfg, "SELECT id FROM stage_procs WHERE stage = 'train'")) == tried + 3, "re-armed: 3 tries"
        alerts = rows(cfg, "SELECT data FROM events WHERE kind = 'handoff-alert'")
        assert len(alerts) == 1 and "cannot start 'torchrun'" in alerts[0][0]
        text = eagle3(cfg, "status").stdout
        assert "commands: Slack Socket Mode retrying since" in text and "monitoring and auto-start go on" in text
        assert "network: URLError" in text and "cannot be reached from this host" in text
        stopped = eagle3(cfg, "stop", "train")
        assert stopped.returncode == 0 and stopped.stdout.startswith("train: not running"), stopped.stdout
        assert eagle3(cfg, "stop", "--all").returncode == 0
        time.sleep(2)
        assert status(cfg)["run"] is None, "stop --all closed the run; nothing opened another"
        assert len(rows(cfg, "SELECT id FROM stage_procs WHERE stage = 'train'")) == tried + 3
        first_output = stop_serve(serve)
        assert "commands and buttons: Slack Socket Mode" in first_output and "Traceback" not in first_output
        assert "token` will be unused" not in first_output

        # The operator fixes the training command, restarts the service and starts a second run.
        cfg.write_text(re.sub(r'(\[stages\.train\]\n(?:#[^\n]*\n)*)argv = \[.*?\]\n',
                              lambda m: m.group(1) + f"argv = {json.dumps(stand_in)}\n", cfg.read_text(), flags=re.S))
        assert eagle3(cfg, "check-config").returncode == 0
        serve = start_serve(cfg)
        for args in (["start", "server"], ["start", "extract"]):
            assert eagle3(cfg, *args).returncode == 0
        st = status(cfg)
        run2 = st["run"]
        assert run2 and st["autostart"] == "off", "a new run starts with auto-start off"
        armed = eagle3(cfg, "autostart", "on")
        assert armed.stdout.startswith("auto-start armed"), armed.stdout
        st = wait_for(lambda: (s := status(cfg))["autostart"] == "training-done" and s, timeout=150, interval=1.0,
                      what="the second run to hand off and train")
        assert st["stages"]["server"]["state"] == "stopped" and st["stages"]["train"]["exit_code"] == 0
        assert len((tmp_path / "ws" / "ckpt" / "launches.txt").read_text().splitlines()) == 1
        status_post = rows(cfg, f"SELECT MIN(id) FROM outbox WHERE update_key = 'status:{run2}'")[0][0]
        first_reply = rows(cfg, f"SELECT MIN(id) FROM outbox WHERE thread_key = 'status:{run2}'")[0][0]
        assert status_post is not None and status_post < first_reply, "the run's status post comes first"
    finally:
        if serve:
            stop_serve(serve)
        eagle3(cfg, "stop", "--all", "--grace", "2")
