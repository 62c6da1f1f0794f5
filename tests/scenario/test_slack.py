"""The Slack app over real signed HTTP, against a fake Slack Web API."""

from __future__ import annotations

import json
import time
from urllib.parse import urlencode

import pytest
from slack_sdk.models.blocks import Block

from tests.conftest import eagle3, wait_for
from tests.scenario.slack_kit import SECRET, audit, click, command, signed, slack_env, value_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def slack(tmp_path):
    """Extraction stopped at 40 of 100."""
    with slack_env(tmp_path, "100", "0", "40") as env:
        yield env

def test_status_is_block_kit_within_limits(slack):
    r = command(slack, "")
    assert r.status_code == 200
    msg = r.json()
    assert "extract: dead" in msg["text"]
    for b in msg["blocks"]:
        assert Block.parse(b).to_dict() == b  # valid for slack_sdk's models
    assert len(msg["blocks"]) <= 50
    text = json.dumps(msg)
    assert "40.0 % (40 / 100)" in text and "Auto-start training when extraction finishes" in text


def test_a_slash_command_is_parsed_once_by_the_middleware(slack, monkeypatch):
    """The listener answers from the middleware's parse (Bolt's request context), never parsing the text again."""
    import handlers.auth
    import handlers.slash

    seen = []
    real = handlers.auth.parse

    def counted(text):
        seen.append(text)
        return real(text)

    def refused(text):
        raise AssertionError("the listener parsed the command again")

    monkeypatch.setattr(handlers.auth, "parse", counted)
    monkeypatch.setattr(handlers.slash, "parse", refused)
    r = command(slack, "eta")
    assert r.status_code == 200 and "extract" in r.json()["text"], r.text
    assert seen == ["eta"]


@pytest.mark.parametrize("how", ["wrong-secret", "stale", "unsigned"])
def test_bad_signatures_are_401(slack, how):
    body = urlencode({"command": "/eagle3", "text": "status", "user_id": "UOK", "channel_id": "C1"})
    r = {"wrong-secret": lambda: signed(slack["url"], body, secret="nope"),
         "stale": lambda: signed(slack["url"], body, ts=int(time.time()) - 600),
         "unsigned": lambda: signed(slack["url"], body, sign=False)}[how]()
    assert r.status_code == 401


def test_malformed_payload_is_400_not_a_dropped_connection(slack):
    r = signed(slack["url"], "payload=%7Bnot-json")
    assert r.status_code == 400 and "malformed" in r.text


def test_train_at_40_percent_is_refused_with_the_numbers(slack):
    msg = command(slack, "train").json()
    assert "extraction is 40.0 % done (40 / 100)" in msg["text"]
    assert "`/eagle3 autostart on`" in msg["text"] and "`eagle3 start train --force` on the host" in msg["text"]
    assert any(b["type"] == "actions" for b in msg["blocks"]), "offers auto-start"
    assert ("slack:UOK", "C1", "train", "done") in audit(slack["cfg"])


def test_mutations_need_an_allowed_user_and_are_audited(slack):
    msg = command(slack, "autostart on", user="UNOPE").json()
    assert "is not allowed" in msg["text"] and "allowed_user_ids" in msg["text"]
    assert json.loads(eagle3("status", "--json", "--config", str(slack["cfg"])).stdout)["autostart"] == "off"
    assert ("slack:UNOPE", "C1", "autostart on", "refused") in audit(slack["cfg"])
    assert command(slack, "stuck", user="UNOPE").status_code == 200  # read-only: anyone


def test_eta_answers_the_eta_and_stuck_the_evidence(slack):
    eta, stuck = command(slack, "eta").json()["text"], command(slack, "stuck").json()["text"]
    assert eta != stuck
    assert eta.startswith("*extract*: dead, 40.0 % (40 / 100)") and "ETA" not in eta  # a dead stage has none
    assert "*verdict* dead" in stuck and "• exited early at 40.0 %" in stuck and "  - " not in stuck


def test_chart_is_asked_for_and_says_where_it_will_appear(slack):
    assert "nothing observed of train yet" in command(slack, "chart train").json()["text"]
    assert "name server, extract or train" in command(slack, "chart nonsense").json()["text"]
    text = command(slack, "chart").json()["text"]  # no serve here: the request waits for it
    assert text == "The extract chart will be posted when `eagle3 serve` runs again (it is not running).", text


def test_the_auto_start_button_asks_slacks_confirm_dialog_first(slack):
    blocks = command(slack, "status").json()["blocks"]
    button = next(e for b in blocks if b["type"] == "actions" for e in b["elements"]
                  if e["action_id"] == "eagle3_autostart_on")
    assert button["confirm"]["title"]["text"] == "Auto-start training?"
    assert "server is stopped — for everyone using it" in button["confirm"]["text"]["text"]


def test_arming_auto_start_is_posted_to_the_channel_with_its_actor(slack):
    assert "armed" in command(slack, "autostart on").json()["text"]
    posted = wait_for(lambda: [p for p in slack["fake"].of("response_url") if p.get("response_type") == "in_channel"],
                      what="the channel's note")
    assert posted[0]["text"].startswith("<@UOK> `/eagle3 autostart on`: ")


def test_every_listener_passes_the_middleware_a_new_one_too(slack):
    """Authorization and audit are one Bolt middleware (issue 36): a listener registered later, which checks
    nothing itself, is refused for a stranger — it never runs — and the refusal is audited."""
    ran = []

    @slack["app"].action("eagle3_something_new")
    def something_new(ack, body):
        ack()
        ran.append(body["user"]["id"])

    assert click(slack, "eagle3_something_new", "{}", user="UNOPE").status_code == 200
    refused = wait_for(lambda: slack["fake"].of("response_url"), what="the refusal")[0]
    assert "<@UNOPE> is not allowed" in refused["text"] and refused["response_type"] == "ephemeral"
    assert ("slack:UNOPE", "C1", "eagle3_something_new", "refused") in audit(slack["cfg"])
    assert click(slack, "eagle3_something_new", "{}").status_code == 200
    wait_for(lambda: ran == ["UOK"], what="the allowed user's click to reach the listener")
    assert ran == ["UOK"]


def test_a_typo_says_unknown_command_and_the_nearest_one(slack):
    text = command(slack, "statsu").json()["text"]
    assert text.startswith("unknown command `statsu` — did you mean `status`?") and "commands:" in text


def test_unknown_and_overlong_text_get_help(slack):
    assert "commands:" in command(slack, "rm -rf /").json()["text"]
    assert "commands:" in command(slack, "status " + "x" * 500).json()["text"]


def test_button_double_click_is_one_state_change_and_updates_the_message(slack):
    blocks = command(slack, "status").json()["blocks"]
    button = next(e for b in blocks if b["type"] == "actions" for e in b["elements"]
                  if e["action_id"] == "eagle3_autostart_on")
    assert click(slack, "eagle3_autostart_on", button["value"]).status_code == 200
    assert click(slack, "eagle3_autostart_on", button["value"]).status_code == 200
    fake = slack["fake"]
    # the work after the ack runs in the app's pool: 10 s was not always enough on 2 saturated cores
    wait_for(lambda: fake.of("chat.update") and fake.of("response_url"), timeout=30, what="update and stale answer")
    update = fake.of("chat.update")[0]
    assert update["ts"] == "1790000000.000100" and "chose *Auto-start training*" in update["text"]
    # the status post keeps being the status, with the outcome as a context line and buttons for the new state
    shown = json.dumps(update["blocks"])
    assert "*Run " in shown and "40.0 % (40 / 100)" in shown and "chose *Auto-start training*" in shown
    assert "Cancel auto-start" in shown and "Auto-start training when extraction finishes" not in shown
    # the second click's action has become meaningless: it is answered with the state as it is now
    stale = fake.of("response_url")[0]
    assert "auto-start is already armed" in stale["text"] and "Cancel auto-start" in json.dumps(stale["blocks"])
    rows = audit(slack["cfg"])
    assert rows.count(("slack:UOK", "C1", "Auto-start training", "done")) == 1
    assert ("slack:UOK", "C1", "Auto-start training", "stale") in rows
    # issue 35: the Cancel button drawn then still cancels after two monitor ticks moved the handoff on
    cancel = next(e for b in update["blocks"] if b["type"] == "actions" for e in b["elements"]
                  if e["action_id"] == "eagle3_autostart_off")
    from pipeline.config import load_workspace
    from pipeline.handoff.machine import Handoff
    from pipeline.stages.supervisor import Supervisor
    from pipeline.store import Store

    ws = load_workspace(slack["cfg"])
    store = Store(ws.store_path)
    try:
        for _ in range(2):
            Handoff(ws=ws, store=store, supervisor=Supervisor(workspace=ws, store=store)).tick()
        moved = Handoff(ws=ws, store=store, supervisor=Supervisor(workspace=ws, store=store)).state().step
    finally:
        store.close()
    assert moved == "waiting-for-completion" and json.loads(cancel["value"])["v"].endswith(":armed")
    assert click(slack, "eagle3_autostart_off", cancel["value"]).status_code == 200
    wait_for(lambda: len(fake.of("chat.update")) >= 2, what="the cancel's update")
    assert "chose *Cancel auto-start*" in fake.of("chat.update")[-1]["text"]
    assert audit(slack["cfg"]).count(("slack:UOK", "C1", "Cancel auto-start", "done")) == 1


def test_serve_http_end_to_end(tmp_path):
    """The real `eagle3 serve --http`: signed command and click answered, the scheduled status post
    (APScheduler, every 0.02 min here) posted once and then updated in place."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    extra = 'channel = "C1"\npost_interval_min = 0.02\n[monitor]\ntick_s = 0.3\n'
    with slack_env(tmp_path, "100", "0", "40", extra=extra) as slack:
        fake = slack["fake"]
        env = dict(os.environ, SLACK_SIGNING_SECRET=SECRET, SLACK_BOT_TOKEN="xoxb-test",
                   SLACK_API_URL=fake.url + "/api/")
        proc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--http", "--port", "0", "--config",
                                 str(slack["cfg"])], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            banner = ""
            while "Slack HTTP events on " not in banner:  # Bolt may log a warning line first
                banner = proc.stdout.readline()
                assert banner, "serve exited before its banner"
            url = banner.split("Slack HTTP events on ")[1].split(";")[0]
            other = {**slack, "url": url}
            blocks = command(other, "status").json()["blocks"]
            assert signed(url, "text=status", secret="wrong").status_code == 401
            assert click(other, "eagle3_later", value_of(blocks, "eagle3_later")).status_code == 200
            wait_for(lambda: len(fake.of("chat.update")) >= 3, timeout=30, what="the status post updated 2 times")
        finally:
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
        statuses = [p for p in fake.of("chat.postMessage") if "*Run " in p.get("text", "") + str(p.get("blocks"))]
        assert len(statuses) == 1, out
        status_ts = f"1790000000.{fake.calls.index(('chat.postMessage', statuses[0])) + 1:06d}"
        assert {u["ts"] for u in fake.of("chat.update") if u["ts"] != "1790000000.000100"} == {status_ts}
        assert any("Check back" in u["text"] or "remind" in u["text"] for u in fake.of("chat.update")), out
        assert "xoxb-test" not in out and SECRET not in out
    missing = eagle3("serve", "--http", "--config", str(slack["cfg"]), env={"SLACK_SIGNING_SECRET": ""})
    assert missing.returncode == 2 and "set SLACK_SIGNING_SECRET" in missing.stderr


def test_stop_asks_to_confirm_then_stops_the_group(slack):
    assert eagle3("start", "train", "--force", "--config", str(slack["cfg"])).returncode == 0
    msg = command(slack, "stop train").json()
    assert "Stop *train*?" in msg["text"]
    confirm = next(e for b in msg["blocks"] if b["type"] == "actions" for e in b["elements"]
                   if e["action_id"] == "eagle3_confirm")["confirm"]  # Slack's own dialog before the click
    assert confirm["title"]["text"] == "Stop train?" and "SIGKILL after the grace period" in confirm["text"]["text"]
    assert json.loads(eagle3("status", "--json", "--config", str(slack["cfg"])).stdout)["stages"]["train"]["state"] \
        == "running", "nothing happens before the confirmation"
    assert click(slack, "eagle3_confirm", value_of(msg["blocks"], "eagle3_confirm")).status_code == 200
    wait_for(lambda: any(p.get("text", "").startswith("<@UOK> confirmed *stop train* on `") and "train: stopped" in
                         p["text"] and p.get("response_type") == "in_channel" for p in slack["fake"].of("response_url")),
             timeout=60, what="the stop to be reported")
    st = json.loads(eagle3("status", "--json", "--config", str(slack["cfg"])).stdout)["stages"]["train"]
    assert st["state"] == "stopped"
    assert ("slack:UOK", "C1", "stop train", "confirmed") in audit(slack["cfg"])


def test_show_logs_is_redacted(slack, monkeypatch):
    canary = "-".join(["xoxb", "1234567890", "canary", "token", "value"])  # built here: no token-like literal
    monkeypatch.setenv("SLACK_BOT_TOKEN", canary)
    with open(slack["cfg"].parent / ".eagle3" / "logs" / "extract.log", "a") as fh:
        fh.write(f"debug: using token {canary}\nAuthorization: Bearer sekret-value\n")
    assert click(slack, "eagle3_show_logs", "extract").status_code == 200
    posted = wait_for(lambda: slack["fake"].of("response_url"), what="the log excerpt")[0]
    text = json.dumps(posted)
    assert "sample 40/100" in text and canary not in text and "sekret-value" not in text and "[redacted]" in text


def test_train_on_a_complete_looking_run_verifies_after_the_ack(tmp_path):
    # The stand-in writes junk sample files: only the verification after the ack can catch that.
    with slack_env(tmp_path, "20", "0", extra="[handoff]\nverify_sample = 5\n") as env:
        asked = command(env, "train").json()
        button = next(e for b in asked["blocks"] if b["type"] == "actions" for e in b["elements"])
        assert "Start training?" in asked["text"] and button["action_id"] == "eagle3_train"
        assert button["confirm"]["title"]["text"] == "Start training?"  # Slack's own dialog before the click
        assert click(env, "eagle3_train", button["value"]).status_code == 200
        later = wait_for(lambda: [p for p in env["fake"].of("response_url") if "refusing" in p.get("text", "")],
                         what="the deferred answer")[0]
        assert later["text"].startswith("<@UOK> `/eagle3 train`: refusing to start training") and "verify found" in \
            later["text"] and later["response_type"] == "in_channel"


def test_acks_never_wait_for_a_slow_rate_limiting_slack(slack):
    """Slack on a bad day: every Web API and response_url call answers after 4 s, and the first
    chat.update and chat.postMessage get 429 with Retry-After 5. Acks still come within 1 s."""
    fake = slack["fake"]
    fake.delay_s = 4.0
    fake.script["chat.update"] = [("429", 5)]
    fake.script["chat.postMessage"] = [("429", 5)]
    blocks = command(slack, "status").json()["blocks"]
    later, auto = value_of(blocks, "eagle3_later"), value_of(blocks, "eagle3_autostart_on")
    for what, send in [("command", lambda: command(slack, "status")),
                       ("click", lambda: click(slack, "eagle3_later", later)),
                       ("stranger's click", lambda: click(slack, "eagle3_autostart_on", auto, user="UNOPE")),
                       ("stranger's command", lambda: command(slack, "autostart on", user="UNOPE"))]:
        t = time.monotonic()
        assert send().status_code == 200
        assert time.monotonic() - t < 1.0, f"the {what} was acknowledged only after {time.monotonic() - t:.1f} s"
    wait_for(lambda: fake.of("chat.update") and fake.of("response_url"), timeout=30, interval=0.2,
             what="the follow-ups to reach the slow Slack after the acks")


def test_a_stuck_client_does_not_silence_the_bot(slack):
    """A client that sends headers and then nothing, held open, while Slack's signed commands are answered."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(slack["url"])
    stuck = socket.create_connection((url.hostname, url.port))
    try:
        stuck.sendall(b"POST /slack/events HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")  # and no more
        for _ in range(3):
            t = time.monotonic()
            assert command(slack, "status").status_code == 200
            assert time.monotonic() - t < 2.0
        big = "x" * (2 << 20)
        assert signed(slack["url"], big).status_code == 413
    finally:
        stuck.close()


def test_show_stacks_is_read_only_and_asks_the_notifier_to_gather_into_the_alerts_thread(slack):
    """Issue 52: anyone in an allowed channel may press Show stacks (a stranger too: it changes nothing); the click
    records a stacks-request that serve's notifier gathers beside the tick, and the clicker is told where it comes."""
    import sqlite3

    r = click(slack, "eagle3_show_stacks", "extract", user="USTRANGER", ephemeral=True)
    assert r.status_code == 200
    said = wait_for(lambda: [p for p in slack["fake"].of("response_url") if "gathering extract's stacks" in
                             p.get("text", "")], what="the answer to Show stacks")
    assert said[0].get("response_type") == "ephemeral"
    conn = sqlite3.connect(slack["cfg"].parent / ".eagle3" / "state.sqlite")
    rows = conn.execute("SELECT stage, data FROM events WHERE kind = 'stacks-request'").fetchall()
    conn.close()
    assert rows == [("extract", json.dumps({"by": "slack:USTRANGER"}))]
