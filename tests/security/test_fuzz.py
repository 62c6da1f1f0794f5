"""Property-based fuzzing of what arrives from outside: slash-command text, `block_actions`
payloads and config files. No crash, no 5xx, no traceback to a user, one line for a bad config."""

from __future__ import annotations

import json
import logging
import string
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.render.alerts import ACTION_LOGS, ACTION_SNOOZE
from handlers.render.blocks import (
    ACTION_AUTOSTART,
    ACTION_CANCEL,
    ACTION_CONFIRM,
    ACTION_KEEP,
    ACTION_LATER,
)
from handlers.verbs import SUBCOMMANDS
from pipeline.config import parse_config
from pipeline.errors import ConfigError
from tests.scenario.slack_kit import signature_headers, slack_env, wsgi_post

pytestmark = pytest.mark.timeout(300)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
ACTION_IDS = [ACTION_AUTOSTART, ACTION_CANCEL, ACTION_CONFIRM, ACTION_KEEP, ACTION_LATER, ACTION_LOGS, ACTION_SNOOZE,
              "eagle3_unknown", ""]


class Failures(logging.Handler):
    """Collects listener failures that Bolt's error handler logged (a bug even when the answer was fine)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record) -> None:
        self.records.append(record.getMessage())


@pytest.fixture(scope="module")
def app_env(tmp_path_factory):
    """One workspace (extraction stopped at 40 of 100) and app for every example: cheap per request."""
    failures = Failures()
    logging.getLogger().addHandler(failures)
    try:
        with slack_env(tmp_path_factory.mktemp("fuzz"), "100", "0", "40") as env:
            yield {**env, "failures": failures.records}
    finally:
        logging.getLogger().removeHandler(failures)


def words():
    verbs = [u.split()[0] for u in SUBCOMMANDS] + ["autostart on", "autostart off", "stop extract", "restart train",
                                                   "logs server", "later 30m", "later eta"]
    junk = st.text(alphabet=string.printable + "éø€—\u202e\u0000", max_size=60)
    return st.one_of(
        st.text(max_size=400),
        st.builds(lambda v, j: f"{v} {j}", st.sampled_from(verbs), junk),
        st.builds(lambda v, j: f"{j}{v}", st.sampled_from(verbs), st.sampled_from(["", " ", "  ", "\t", "\n"])),
    )


def post(env, body: str) -> tuple[int, str]:
    return wsgi_post(env, body, signature_headers(body))


def assert_clean(env, code: int, out: str) -> None:
    assert code < 500, (code, out[:300])
    assert "Traceback" not in out and 'File "' not in out
    failed = [r for r in env["failures"] if "listener failed" in r or "Traceback" in r]
    env["failures"].clear()
    assert not failed, failed


@FUZZ
@given(text=words(), user=st.sampled_from(["UOK", "UNOPE", "", "U" + "9" * 40]),
       channel=st.sampled_from(["C1", "", "C" * 300]))
def test_slash_text_never_crashes(app_env, text, user, channel):
    body = urlencode({"command": "/eagle3", "text": text, "user_id": user, "user_name": "op", "channel_id": channel,
                      "team_id": "T1", "response_url": app_env["fake"].url + "/respond/f", "trigger_id": "1.2",
                      "api_app_id": "A1"})
    code, out = post(app_env, body)
    assert_clean(app_env, code, out)
    assert code == 200
    answer = json.loads(out)
    assert answer.get("text"), "every command gets an answer"


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                                      max_size=3), max_leaves=8)


def action_payloads():
    value = st.one_of(st.text(max_size=80), json_values.map(json.dumps),
                      st.sampled_from(["[1]", "5", "null", '"s"', '{"v": 5}', '{"v": null, "stage": 7}', ""]),
                      st.builds(lambda v, verb, stage: json.dumps({"v": v, "verb": verb, "stage": stage}),
                                st.text(max_size=20), st.sampled_from(["stop", "restart", "x", ""]),
                                st.sampled_from(["server", "extract", "train", "../etc", ""])))
    action = st.fixed_dictionaries({"action_id": st.sampled_from(ACTION_IDS), "block_id": st.text(max_size=5),
                                    "type": st.just("button")}, optional={"value": value})
    return st.fixed_dictionaries({
        "type": st.sampled_from(["block_actions", "block_actions", "interactive_message", "nonsense"]),
        "user": st.one_of(st.fixed_dictionaries({"id": st.sampled_from(["UOK", "UNOPE"])}), json_values),
        "channel": st.one_of(st.fixed_dictionaries({"id": st.sampled_from(["C1", "C2"])}), json_values),
        "actions": st.one_of(st.lists(action, min_size=1, max_size=2), json_values),
        "container": st.one_of(st.fixed_dictionaries({"message_ts": st.text(max_size=20), "is_ephemeral": st.booleans(),
                                                      "channel_id": st.just("C1")}), json_values),
    }, optional={"team": st.fixed_dictionaries({"id": st.just("T1")}), "api_app_id": st.just("A1")})


@FUZZ
@given(payload=action_payloads())
def test_block_actions_never_crash(app_env, payload):
    payload["response_url"] = app_env["fake"].url + "/respond/b"
    code, out = post(app_env, urlencode({"payload": json.dumps(payload)}))
    assert_clean(app_env, code, out)


@pytest.mark.parametrize("actions", [[], [{}], [{"action_id": 5}]])
def test_block_actions_without_an_action_id_get_400(app_env, actions):
    # found by the fuzzer in CI: Bolt indexes actions[0]["action_id"] and answered 500 / a failed listener
    payload = {"type": "block_actions", "user": {"id": "UOK"}, "channel": {"id": "C1"}, "actions": actions,
               "container": {"message_ts": "", "channel_id": "C1"}, "response_url": app_env["fake"].url + "/respond/b"}
    code, out = post(app_env, urlencode({"payload": json.dumps(payload)}))
    assert code == 400
    assert_clean(app_env, code, out)


@FUZZ
@given(raw=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_signed_body_gets_an_answer(app_env, raw):
    code, out = post(app_env, raw)
    assert_clean(app_env, code, out)


keys = st.sampled_from(["state", "monitor", "handoff", "slack", "stages", "stages.server", "stages.extract",
                        "stages.train", "bogus"])
fields = st.sampled_from(["dir", "tick_s", "argv", "gpus", "channel", "allowed_user_ids", "redact_patterns", "url",
                          "port", "restart", "max_restarts", "out", "progress_regex", "max_failed_share",
                          "post_interval_min", "log_max_bytes", "env", "cwd", "nonsense"])
toml_values = st.one_of(st.integers(min_value=-10**12, max_value=10**12), st.floats(allow_nan=False, allow_infinity=False),
                        st.booleans(), st.text(max_size=30), st.lists(st.text(max_size=8), max_size=3),
                        st.lists(st.integers(min_value=-3, max_value=20), max_size=4),
                        st.sampled_from(["(", "[a-", "*", "(?P<done>\\d+)", "on-failure", "never", "http://x:1"]))


def toml(sections: dict) -> str:
    lines = []
    for section, items in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in items.items()]
    return "\n".join(lines) + "\n"


@FUZZ
@given(text=st.one_of(st.dictionaries(keys, st.dictionaries(fields, toml_values, max_size=4), max_size=4).map(toml),
                      st.text(max_size=200)))
def test_config_files_give_one_line_or_a_config(text):
    try:
        parse_config(text, name="eagle3.toml")
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("eagle3.toml") and "\n" not in message and len(message) < 600, message
