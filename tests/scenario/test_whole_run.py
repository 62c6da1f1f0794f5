"""A whole `init --demo` run under `eagle3 serve --http`, told through a fake Slack Web API (issue 50).

server → extraction → a wedged server, flagged, escalated and acknowledged, that recovers by itself →
auto-start → 2-process training → the run's end. The recorded calls are what a channel would show.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from urllib.parse import urlencode

import pytest

from pipeline.toy.demo_workspace import write_demo_workspace
from tests.conftest import ROOT, eagle3, wait_for
from tests.scenario.slack_kit import SECRET, audit, signed
from tests.support.fake_slack import FakeSlack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANG_AFTER, HANG_FOR_S = 24, 26  # the toy server wedges on its 25th /generate and recovers 26 s later


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _texts(params: dict) -> str:
    """Everything a message shows: its text and blocks."""
    return f"{params.get('text', '')} {params.get('blocks', '')}"


def _click_ack(url: str, fake: FakeSlack, alert: dict, ts: str, user: str) -> None:
    blocks = json.loads(alert["blocks"]) if isinstance(alert["blocks"], str) else alert["blocks"]
    payload = {"type": "block_actions", "user": {"id": user}, "channel": {"id": "C1"}, "team": {"id": "T1"},
               "api_app_id": "A1", "response_url": fake.url + "/respond/ack", "trigger_id": "1.4",
               "container": {"type": "message", "message_ts": ts, "channel_id": "C1", "is_ephemeral": False},
               "message": {"ts": ts, "text": alert["text"], "blocks": blocks},
               "actions": [{"action_id": "eagle3_ack", "block_id": "b", "value": "extract", "type": "button"}]}
    r = signed(url, urlencode({"payload": json.dumps(payload)}))
    assert r.status_code == 200, r.text


def test_a_whole_demo_run_told_in_a_channel(tmp_path):
    fake = FakeSlack()
    cfg = write_demo_workspace(tmp_path / "ws", steps=10, samples=60)
    text = re.sub(r'("toy-server", "--port", "\d+")',
                  rf'\1, "--hang-after", "{HANG_AFTER}", "--hang-for", "{HANG_FOR_S}"', cfg.read_text())
    text = text.replace("stall_floor_s = 30", "stall_floor_s = 5")
    # one training process: the 2-process torchrun is the demo's and test_train's to prove, this story's is the channel
    text = text.replace('"--nproc-per-node", "2"', '"--nproc-per-node", "1"')
    cfg.write_text('[slack]\nchannel = "C1"\nallowed_user_ids = ["UOK"]\noncall_user_ids = ["UONCALL"]\n'
                   'min_edit_s = 1\nescalate_after_min = 0.05\n' + text)
    port = _free_port()
    env = {**os.environ, "SLACK_BOT_TOKEN": "xoxb-test", "SLACK_SIGNING_SECRET": SECRET,
           "SLACK_API_URL": fake.url + "/api/"}
    serve = None
    try:
        for verb in (("start", "server"), ("start", "extract"), ("autostart", "on")):
            assert eagle3(*verb, "--config", str(cfg)).returncode == 0, verb
        serve = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--http", "--port", str(port),
                                  "--config", str(cfg)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}/slack/events"

        def ts_of(params: dict) -> str:
            return f"1790000000.{fake.calls.index(('chat.postMessage', params)) + 1:06d}"

        def posted(pred) -> list[dict]:
            return [p for p in fake.of("chat.postMessage") if pred(p)]

        alert = wait_for(lambda: next(iter(posted(lambda p: "eagle3_ack" in str(p.get("blocks")))), None),
                         timeout=150, interval=0.5, what="the stall alert")
        alert_ts = ts_of(alert)
        escalation = wait_for(lambda: next(iter(posted(lambda p: p.get("thread_ts") == alert_ts
                                                       and "still stalled" in p.get("text", ""))), None),
                              timeout=60, interval=0.5, what="the escalation")
        _click_ack(url, fake, alert, alert_ts, "UOK")
        wait_for(lambda: any(u["ts"] == alert_ts and "<@UOK> is on it" in _texts(u) for u in fake.of("chat.update")),
                 timeout=20, interval=0.5, what="the alert to say who is on it")
        status_ts = ts_of(posted(lambda p: "*Run " in str(p.get("blocks")))[0])

        def final():  # the final render, once the channel also had training's ending (the outbox paces at 1/s)
            ups = [u for u in fake.of("chat.update") if u["ts"] == status_ts]
            ended = posted(lambda p: re.search(r"\*train is done\*|training-done", p.get("text", "")))
            return ended and ups and "actions" not in str(ups[-1].get("blocks")) and ups[-1]

        last = wait_for(final, timeout=240, interval=1.0, what="the status post's final render and training's end")
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            log = serve.communicate(timeout=60)[0]
            print(log[-6000:])  # shown when the test fails
            print("\n".join(f"{m} {str(p)[:300]}" for m, p in fake.calls))
        eagle3("stop", "--all", "--grace", "2", "--config", str(cfg))
        fake.close()
    assert serve.returncode == 0, log
    assert "Traceback" not in log, log

    # the final render: every stage's ending, no live button, and nothing edits it afterwards
    final_text = _texts(last)
    for said in ("*server*: stopped after", "(stopped on request)", "*extract*: done", "*train*: done", "τ ≈ ",
                 "GPU-hours in all"):
        assert said in final_text, final_text
    assert [u for u in fake.of("chat.update") if u["ts"] == status_ts][-1] is last

    # one ending per stage reaches the channel (top level, or broadcast from the run's thread)
    channel = [p for p in fake.of("chat.postMessage") if not p.get("thread_ts") or p.get("reply_broadcast")]
    extract_ends = [p for p in channel if "*extract is done*" in p.get("text", "")]
    train_ends = [p for p in channel if re.search(r"\*train is done\*|training-done", p.get("text", ""))]
    assert len(extract_ends) == 1 and len(train_ends) == 1, [p.get("text") for p in channel]

    # the wedge is a stall although its requests are "running" on a healthy server (health still passes), flagged
    # within the stall floor and a few ticks of the last progress (the real server once: test_monitor's stand-ins
    # cover the rest)
    assert "request(s) 'running' on a healthy server but none completed" in alert["text"], alert["text"]
    quiet = int(re.search(r"no progress for (\d+)s", alert["text"]).group(1))
    assert quiet <= 5 + 3 * 1 + 5, alert["text"]
    # issue 52: the evidence gathered at the stall, beside the tick, in the alert's thread: the stuck client's and the
    # server's frames from the real py-spy, with the whole as a file
    evidence = [p for p in fake.of("files.completeUploadExternal") if p.get("thread_ts") == alert_ts
                and "Evidence of extract, gathered at the stall" in p.get("initial_comment", "")]
    said = evidence[0]["initial_comment"] if len(evidence) == 1 else evidence
    assert re.search(r"extract: pid \d+ in ", said), said
    # the wedged server holds the client's requests: the client's own account and the server's /v1/loads, in a line
    assert re.search(r"client: \d+ requests? in flight, the oldest [\dhms]+ \(sample \d+, [\d,]+ tokens\); the server "
                     r"runs [1-9]\d*, queues 0: the server holds them; the last sample written [\dhms]+ ago", said), said
    kept = sorted((tmp_path / "ws" / ".eagle3" / "forensics").rglob("evidence.txt"))
    assert kept and "=== the extraction client's own state ===" in kept[0].read_text()
    # the client is blocked in a read: its parse worker's request threads wait in a socket read of the server's
    # answer, from py-spy's real output
    assert re.search(r"pid \d+ in [^;]*\d threads? in SocketIO\.readinto \(socket\.py:", said), said
    # the escalation: a reply in the alert's thread, broadcast, mentioning on-call; resolved in place with the alert
    assert escalation.get("reply_broadcast") in (True, "true", "1", 1) and "<@UONCALL>" in escalation["text"]
    escalation_ts = ts_of(escalation)
    for ts in (alert_ts, escalation_ts):
        ups = [u for u in fake.of("chat.update") if u["ts"] == ts]
        assert ups and "resolved after" in ups[-1]["text"], (ts, ups)
    # the alert was acknowledged by UOK: audited, and the resolved alert still says who took it
    assert ("slack:UOK", "C1", "Acknowledge", "done") in audit(cfg)
    assert "<@UOK>" in [u for u in fake.of("chat.update") if u["ts"] == alert_ts][-1]["text"]
    assert len(posted(lambda p: "still stalled" in p.get("text", ""))) == 1  # escalated once, before the ack

    # handoff steps, each once in the run's thread
    replies = [p["text"] for p in posted(lambda p: p.get("thread_ts") == status_ts)]
    for step in ("waiting-for-completion", "stopping-server", "launching-training"):
        assert sum(f"*{step}*" in r for r in replies) <= 1, replies

    # no relative time frozen into a message: "… ago" only inside a Slack date token that stays current
    for method in ("chat.postMessage", "chat.update"):
        for p in fake.of(method):
            shown = re.sub(r"<!date\^[^>]*>", "", _texts(p))
            assert not re.search(r"\d+\s*[smhd]\w* ago", shown), shown
