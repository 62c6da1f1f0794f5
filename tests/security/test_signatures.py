"""Only requests signed with the signing secret, within 5 minutes, reach a listener."""

from __future__ import annotations

import sqlite3
import time
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.scenario.slack_kit import signature_headers, signed, slack_env, wsgi_post

pytestmark = pytest.mark.timeout(120)
BODY = urlencode({"command": "/eagle3", "text": "autostart on", "user_id": "UOK", "channel_id": "C1",
                  "team_id": "T1", "response_url": "http://127.0.0.1:9/r", "trigger_id": "1", "api_app_id": "A1"})


@pytest.fixture(scope="module")
def app_env(tmp_path_factory):
    with slack_env(tmp_path_factory.mktemp("sig"), "100", "0", "40") as env:
        yield env


def audited(env) -> int:
    conn = sqlite3.connect(env["cfg"].parent / ".eagle3" / "state.sqlite")
    n = conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
    conn.close()
    return n


CASES = {
    "missing": lambda: {},
    "timestamp only": lambda: {"X-Slack-Request-Timestamp": str(int(time.time()))},
    "signature only": lambda: {"X-Slack-Signature": signature_headers(BODY)["X-Slack-Signature"]},
    "timestamp not a number": lambda: {**signature_headers(BODY), "X-Slack-Request-Timestamp": "soon"},
    "wrong secret": lambda: signature_headers(BODY, secret="not-the-secret"),
    "stale (6 min old)": lambda: signature_headers(BODY, ts=int(time.time()) - 360),
    "from the future (6 min ahead)": lambda: signature_headers(BODY, ts=int(time.time()) + 360),
    "signature over another body": lambda: signature_headers(BODY.replace("autostart+on", "status")),
    "v1 scheme": lambda: {**signature_headers(BODY), "X-Slack-Signature": "v1=" + "0" * 64},
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_signature_is_401_and_nothing_acts(app_env, case):
    before = audited(app_env)
    code, out = wsgi_post(app_env, BODY, CASES[case]())
    assert code == 401, (case, out)
    assert audited(app_env) == before


def test_a_replayed_request_is_401(app_env):
    """A request captured from the wire and sent again after the 5-minute window."""
    captured = signature_headers(BODY, ts=int(time.time()) - 301)
    before = audited(app_env)
    for _ in range(2):
        assert signed(app_env["url"], BODY, ts=int(captured["X-Slack-Request-Timestamp"])).status_code == 401
    assert audited(app_env) == before


def test_a_valid_signature_is_accepted(app_env):
    """The control: the same request, correctly signed, acts (and is audited)."""
    before = audited(app_env)
    code, _ = wsgi_post(app_env, BODY, signature_headers(BODY))
    assert code == 200 and audited(app_env) > before


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ts=st.one_of(st.text(max_size=20), st.integers(-10**12, 10**12).map(str)), sig=st.text(max_size=80))
def test_random_headers_are_401(app_env, ts, sig):
    code, _ = wsgi_post(app_env, BODY, {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig})
    assert code == 401



def test_the_log_tells_a_skewed_clock_from_a_wrong_secret(app_env, caplog):
    """Clock skew must not send the operator hunting for a wrong signing secret."""
    with caplog.at_level("WARNING", logger="eagle3.bot"):
        assert wsgi_post(app_env, BODY, CASES["stale (6 min old)"]())[0] == 401
        assert wsgi_post(app_env, BODY, CASES["wrong secret"]())[0] == 401
    stale, wrong = [r.getMessage() for r in caplog.records if "refused (401)" in r.getMessage()]
    assert "this host's clock is wrong" in stale and "signing secret" not in stale.lower()
    assert "SLACK_SIGNING_SECRET differs" in wrong
