"""Slack test kit: a workspace with the app on port 0 and a fake Web API; signed requests as Slack sends them."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import sqlite3
import time
from contextlib import contextmanager
from urllib.parse import urlencode

import httpx

from bot.app import build_app, serve_http
from pipeline.config import load_workspace
from pipeline.controller import Controller
from tests.conftest import fixture_argv, status_json, wait_for
from tests.support.fake_slack import FakeSlack

SECRET = "test-signing-secret"


def extracted_workspace(tmp_path, *extract_args: str, extra: str = "", train_extra: str = ""):
    """A workspace whose stand-in extraction ran (fake_extract.py OUT TOTAL 0 [EXIT_AT]) to its end;
    training is a sleeper. Returns the config's path."""
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(f'[slack]\nallowed_user_ids = ["UOK"]\n{extra}[stages.extract]\nout = "out"\n'
                   f'argv = {json.dumps(fixture_argv("fake_extract.py", str(tmp_path / "out"), *extract_args))}\n'
                   f'[stages.train]\n{train_extra}argv = {json.dumps(fixture_argv("sleeper.py"))}\n')
    with Controller.open(str(cfg)) as ctl:  # the CLI's verbs, in-process (the CLI itself is tested elsewhere)
        ctl.start("extract")
    wait_for(lambda: status_json(cfg)["stages"]["extract"].get("verdict") in ("dead", "done"),
             what="the stand-in extraction to end")
    return cfg


@contextmanager
def slack_env(tmp_path, *extract_args: str, extra: str = ""):
    """`extracted_workspace`, the app on port 0 and a fake Slack Web API; everything is stopped afterwards."""
    cfg = extracted_workspace(tmp_path, *extract_args, extra=extra)
    fake = FakeSlack()
    app = build_app(ws=load_workspace(cfg), token="xoxb-test", signing_secret=SECRET, api_url=fake.url + "/api/")
    server = serve_http(app, signing_secret=SECRET, port=0)
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}/slack/events", "fake": fake, "cfg": cfg,
               "wsgi": server.get_app(), "app": app}
    finally:
        server.shutdown()
        # what listeners still run after their ack (a confirmed stop, a refusal's answer) ends while the fake Slack
        # still listens: run on, it would fail on a closed port and log into whichever test runs next
        app.listener_runner.listener_executor.shutdown(wait=True)
        fake.close()
        with Controller.open(str(cfg)) as ctl:
            ctl.stop_all(grace_s=1)


def signature_headers(body: str, *, secret: str = SECRET, ts: int | None = None) -> dict:
    """Slack's v0 request signature over `v0:{timestamp}:{body}`."""
    ts = int(time.time()) if ts is None else ts
    digest = hmac.new(secret.encode(), f"v0:{ts}:{body}".encode(), hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": str(ts), "X-Slack-Signature": f"v0={digest}"}


def signed(url: str, body: str, *, secret: str = SECRET, ts: int | None = None, sign: bool = True) -> httpx.Response:
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if sign:
        headers.update(signature_headers(body, secret=secret, ts=ts))
    return httpx.post(url, content=body, headers=headers, timeout=10)


def wsgi_post(env, body: bytes | str, headers: dict | None = None) -> tuple[int, str]:
    """The same request as `signed`, handed to the app's WSGI callable in-process (fast enough to fuzz)."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/slack/events", "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1",
               "SERVER_PORT": "0", "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(raw),
               "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0), "wsgi.multithread": True,
               "wsgi.multiprocess": False, "wsgi.run_once": False,
               "CONTENT_TYPE": "application/x-www-form-urlencoded", "CONTENT_LENGTH": str(len(raw))}
    for k, v in (headers or {}).items():
        environ["HTTP_" + k.upper().replace("-", "_")] = v
    status = {}

    def start_response(s, _headers, _exc=None):
        status["code"] = int(s.split()[0])

    out = b"".join(env["wsgi"](environ, start_response))
    return status["code"], out.decode("utf-8", "replace")


def command(env, text: str, *, user: str = "UOK", channel: str = "C1") -> httpx.Response:
    body = urlencode({"command": "/eagle3", "text": text, "user_id": user, "user_name": "op", "channel_id": channel,
                      "team_id": "T1", "response_url": env["fake"].url + "/respond/1", "trigger_id": "1.2",
                      "api_app_id": "A1"})
    return signed(env["url"], body)


def click(env, action_id: str, value: str, *, user: str = "UOK", ephemeral: bool = False) -> httpx.Response:
    payload = {"type": "block_actions", "user": {"id": user}, "channel": {"id": "C1"}, "team": {"id": "T1"},
               "api_app_id": "A1", "response_url": env["fake"].url + "/respond/2", "trigger_id": "1.3",
               "container": {"type": "message", "message_ts": "1790000000.000100", "channel_id": "C1",
                             "is_ephemeral": ephemeral},
               "actions": [{"action_id": action_id, "block_id": "b", "value": value, "type": "button"}]}
    return signed(env["url"], urlencode({"payload": json.dumps(payload)}))


def audit(cfg) -> list[tuple]:
    conn = sqlite3.connect(cfg.parent / ".eagle3" / "state.sqlite")
    rows = conn.execute("SELECT user, channel, action, outcome FROM audit ORDER BY id").fetchall()
    conn.close()
    return rows


def value_of(blocks, action_id):
    return next(e["value"] for b in blocks if b["type"] == "actions" for e in b["elements"] if e["action_id"] == action_id)
