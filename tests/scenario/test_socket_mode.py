"""Socket Mode as `serve` runs it (bot.service.Inputs), against a local WebSocket handed out by a fake
`apps.connections.open`: acks while the Web API is slow, a dead socket replaced fast, two hosts on one app."""

from __future__ import annotations

import json
import logging
import time

import pytest

from bot.service import Inputs
from pipeline.config import load_workspace
from pipeline.store import Store
from tests.conftest import fixture_argv, wait_for
from tests.scenario.fake_socket import FakeSocketMode
from tests.support.fake_slack import FakeSlack

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def socket_mode(tmp_path, monkeypatch):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[slack]\nchannel = "C1"\nallowed_user_ids = ["UOK"]\n[stages.extract]\nout = "out"\n'
                   f'argv = {json.dumps(fixture_argv("sleeper.py"))}\n')
    fake, sock = FakeSlack(), FakeSocketMode()
    fake.answers["apps.connections.open"] = {"url": sock.url}
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-test")
    monkeypatch.setenv("SLACK_APP_TOKEN", "xapp-test")
    monkeypatch.setenv("SLACK_API_URL", fake.url + "/api/")
    ws = load_workspace(cfg)
    inputs = Inputs(ws=ws)
    inputs.start_socket_mode()
    try:
        wait_for(lambda: len(sock.live()) >= 1, timeout=20, what="the app's Socket Mode connection")
        yield {"fake": fake, "sock": sock, "ws": ws}
    finally:
        inputs.close()
        sock.close()
        fake.close()


def test_acks_within_a_second_while_the_web_api_takes_4_s(socket_mode):
    fake, sock = socket_mode["fake"], socket_mode["sock"]
    fake.delay_s = 4.0
    fake.script["chat.postMessage"] = [("429", 5)]
    sock.send_slash("e-ok", text="status", response_url=fake.url + "/hooks/1")
    sock.send_slash("e-stranger", text="stop --all", user="USTRANGER", response_url=fake.url + "/hooks/2")
    wait_for(lambda: {"e-ok", "e-stranger"} <= set(sock.acks), timeout=10, what="both acks")
    for envelope in ("e-ok", "e-stranger"):
        latency = sock.acks[envelope][0] - sock.sent_at[envelope]
        assert latency < 1.0, (envelope, latency)
    assert sock.acks["e-ok"][1]["envelope_id"] == "e-ok"


def test_a_socket_that_dies_without_a_word_is_replaced_within_15_s_and_two_hosts_are_warned(socket_mode, caplog):
    sock, ws = socket_mode["sock"], socket_mode["ws"]
    caplog.set_level(logging.INFO, logger="eagle3.service")
    sock.num_connections = 2  # the next hello: another host holds a socket of this app too
    first = len(sock.connected_at)
    t0 = time.monotonic()
    sock.go_silent()
    wait_for(lambda: len(sock.connected_at) > first, timeout=30, what="a new connection")
    assert sock.connected_at[first] - t0 <= 15.0, sock.connected_at[first] - t0
    wait_for(lambda: any("Socket Mode reconnected (the previous socket answered no ping for" in r.getMessage()
                         for r in caplog.records), timeout=5, what="the reconnect logged with its cause")

    def warned():
        store = Store(ws.store_path)
        try:
            return [e for e in store.events(kind="transport-warning")]
        finally:
            store.close()

    wait_for(lambda: warned(), timeout=10, what="the two-connections warning")
    reason = warned()[0]["data"]["reason"]
    assert reason.startswith("2 Socket Mode connections share this Slack app (this host: ")
    assert sum("share this Slack app" in r.getMessage() for r in caplog.records) == 1


def test_app_home_opened_publishes_the_home_tab_for_that_user(socket_mode):
    fake, sock, ws = socket_mode["fake"], socket_mode["sock"], socket_mode["ws"]
    store = Store(ws.store_path)
    try:
        store.add_event(kind="handoff", run_id=store.open_run(), data={"step": "armed", "reason": "armed by test"})
        store.put("chart:latest", {"file_id": "F0CHART", "stage": "extract", "t": 1_790_000_000.0})
    finally:
        store.close()
    sock.send_event("e-home", {"type": "app_home_opened", "user": "UHOME", "channel": "D1", "tab": "home",
                               "event_ts": "1790000000.000100"})
    wait_for(lambda: fake.of("views.publish"), timeout=10, what="views.publish")
    time.sleep(0.5)  # nothing else may follow
    (call,) = fake.of("views.publish")
    assert call["user_id"] == "UHOME"
    view = json.loads(call["view"]) if isinstance(call["view"], str) else call["view"]
    assert view["type"] == "home"
    text = json.dumps(view["blocks"])
    assert "*Run " in text and "Last events" in text and "armed by test" in text
    assert '"actions"' not in text  # the status post's buttons act on a channel message: not in Home
    image = next(b for b in view["blocks"] if b["type"] == "image")
    assert image["slack_file"] == {"id": "F0CHART"} and image["alt_text"]  # the latest chart uploaded
    assert sock.acks["e-home"][0] - sock.sent_at["e-home"] < 1.0
