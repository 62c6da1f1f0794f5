"""Secrets stay secret, and Slack text never reaches a shell or a stage's argv."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
from urllib.parse import urlencode

import pytest

from tests.conftest import ROOT, eagle3, fixture_argv, wait_for
from tests.scenario.slack_kit import (
    click,
    command,
    signature_headers,
    signed,
    slack_env,
    value_of,
    wsgi_post,
)
from tests.support.fake_slack import FakeSlack

pytestmark = pytest.mark.timeout(180)


def test_canary_secrets_never_appear_in_logs_posts_errors_store_or_stage_logs(tmp_path):
    token = "xoxb-" + secrets.token_hex(12)
    app_token = "xapp-" + secrets.token_hex(12)
    signing = "canary" + secrets.token_hex(12)
    canaries = [token, app_token, signing]
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[monitor]\ntick_s = 0.3\n[slack]\nchannel = "C1"\nallowed_user_ids = ["UOK"]\n'
                   'post_interval_min = 0.02\nredact_patterns = ["hf_[A-Za-z0-9]+"]\n'
                   f'[stages.extract]\nargv = {json.dumps(fixture_argv("env_echo.py"))}\n'
                   f'[stages.train]\nargv = {json.dumps(fixture_argv("sleeper.py"))}\n')
    fake = FakeSlack()
    env = {"SLACK_BOT_TOKEN": token, "SLACK_APP_TOKEN": app_token, "SLACK_SIGNING_SECRET": signing,
           "SLACK_API_URL": fake.url + "/api/"}
    answers: list[str] = []
    proc = None
    try:
        assert eagle3("start", "extract", "--config", str(cfg), env=env).returncode == 0  # the CLI holds the secrets
        proc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--http", "--port", "0", "--config",
                                 str(cfg)], cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        line = ""
        while "Slack HTTP events on " not in line:
            line = proc.stdout.readline()
            assert line, "serve exited before its banner"
        kit = {"url": line.split("Slack HTTP events on ")[1].split(";")[0], "fake": fake}

        def send(body: str, **kw) -> None:
            answers.append(signed(kit["url"], body, secret=signing, **kw).text)

        for text in ("status", "stuck", "logs extract", "logs server", "train", "help", "gpus", "nonsense"):
            send(urlencode({"command": "/eagle3", "text": text, "user_id": "UOK", "channel_id": "C1",
                            "response_url": fake.url + "/respond/1"}))
        send("payload=%7Bnot-json")  # 400
        send("text=status", ts=1)  # 401
        payload = {"type": "block_actions", "user": {"id": "UOK"}, "channel": {"id": "C1"},
                   "response_url": fake.url + "/respond/2", "container": {"message_ts": "1.1", "channel_id": "C1"},
                   "actions": [{"action_id": "eagle3_show_logs", "value": "extract", "type": "button"}]}
        send(urlencode({"payload": json.dumps(payload)}))
        logs = wait_for(lambda: [c for c in fake.of("response_url") if "log:" in json.dumps(c)], timeout=30,
                        what="the Show logs excerpt")
        wait_for(lambda: len(fake.of("chat.update")) >= 2, timeout=30, what="scheduled status posts")
    finally:
        if proc:
            proc.terminate()
            answers.append(proc.communicate(timeout=30)[0])
        eagle3("stop", "--all", "--grace", "1", "--config", str(cfg))
        fake.close()
    excerpt = json.dumps(logs)
    assert "sample 1/100" in excerpt and "[redacted]" in excerpt
    assert "hunter2-stage-credential" not in excerpt and "hf_AbCdEf0123456789" not in excerpt
    stage_log = (tmp_path / ".eagle3" / "logs" / "extract.log").read_text()
    assert "SLACK_BOT_TOKEN=None" in stage_log, "the stage ran and printed its environment"
    haystacks = {"serve output and HTTP answers": "\n".join(answers), "Slack calls": json.dumps(fake.calls)}
    for path in (tmp_path / ".eagle3").rglob("*"):
        if path.is_file():
            haystacks[str(path)] = path.read_bytes().decode("latin-1")
    conn = sqlite3.connect(tmp_path / ".eagle3" / "state.sqlite")
    haystacks["store rows"] = json.dumps([conn.execute(f"SELECT * FROM {t}").fetchall() for t in
                                          ("kv", "events", "audit", "outbox", "stage_procs", "observations")])
    conn.close()
    for where, text in haystacks.items():
        for canary in canaries:
            assert canary not in text, f"a secret leaked into {where}"


MARK = "zq7mark"


@pytest.fixture
def recorded(monkeypatch):
    """Every process the service starts, and every shell it might open, with argv and environment."""
    calls: list[str] = []
    real_popen_init = subprocess.Popen.__init__

    def popen_init(self, args, *a, **kw):
        calls.append(json.dumps([args, kw.get("env")], default=str))
        return real_popen_init(self, args, *a, **kw)

    def refuse(name):
        def inner(*a, **kw):
            calls.append(json.dumps([name, a], default=str))
            raise AssertionError(f"{name} called")
        return inner

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    for name in ("system", "popen", "execv", "execve", "execvp", "execl", "spawnv", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    return calls


HOSTILE = [f"stop extract; touch /tmp/{MARK}", f"restart train && echo {MARK}", f"logs $(echo {MARK})",
           f"logs `{MARK}`", f"train --force {MARK}", f"autostart on | {MARK}", f"later 1h; {MARK}",
           f"later {MARK}", f"status\n{MARK}", f"restart ../{MARK}"]


def test_slack_text_never_reaches_a_shell_or_argv(tmp_path, recorded):
    with slack_env(tmp_path, "100", "0", "40") as env:
        for text in HOSTILE:
            assert command(env, text).status_code == 200
        # a real restart through the confirmation: the stage starts with its configured argv only
        blocks = command(env, "restart extract").json()["blocks"]
        value = json.loads(value_of(blocks, "eagle3_confirm"))
        forged = json.dumps({**value, "stage": f"extract; touch /tmp/{MARK}"})
        body = urlencode({"payload": json.dumps({
            "type": "block_actions", "user": {"id": "UOK"}, "channel": {"id": "C1"},
            "response_url": env["fake"].url + "/respond/9",
            "actions": [{"action_id": "eagle3_confirm", "value": forged, "type": "button"}]})})
        assert wsgi_post(env, body, signature_headers(body))[0] == 200
        assert click(env, "eagle3_confirm", value_of(blocks, "eagle3_confirm")).status_code == 200
        wait_for(lambda: any("started again" in json.dumps(c) for c in env["fake"].of("response_url")), timeout=60,
                 what="the confirmed restart")
        conn = sqlite3.connect(env["cfg"].parent / ".eagle3" / "state.sqlite")
        argvs = [json.loads(r[0]) for r in conn.execute("SELECT argv FROM stage_procs WHERE stage = 'extract'")]
        conn.close()
    configured = fixture_argv("fake_extract.py", str(tmp_path / "out"), "100", "0", "40")
    assert argvs == [configured, configured], "started once by the fixture, once by the confirmed restart"
    assert recorded, "the restart started a process: the recorder saw it"
    assert not [c for c in recorded if MARK in c]
    assert not os.path.exists(f"/tmp/{MARK}")
