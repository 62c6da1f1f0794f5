"""The deploy kit validates: example config, systemd unit, secrets template, Slack app manifest."""

import configparser
import re
from pathlib import Path

import yaml

from handlers.slash import SUBCOMMANDS
from pipeline.config import PLACEHOLDER, load_workspace

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECRETS = {"SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "SLACK_SIGNING_SECRET"}


def test_example_config_is_valid_and_complete():
    ws = load_workspace(DEPLOY / "eagle3.example.toml")
    assert not PLACEHOLDER.search((DEPLOY / "eagle3.example.toml").read_text())
    for stage in ("server", "extract", "train"):
        ws.require_filled(stage)
    server = ws.stage("server").argv
    for flag in ("--enable-return-hidden-states", "--enable-return-aux-hidden-states",
                 "--disable-radix-cache", "--chunked-prefill-size"):
        assert flag in server
    assert ws.stage("server").gpus == list(range(8))
    assert ws.stage("train").gpus == [0, 1, 2, 3]
    assert ws.stage("train").argv[:4] == ["torchrun", "--standalone", "--nproc-per-node", "4"]
    assert ws.config.slack.channel and ws.config.slack.allowed_user_ids


def test_example_config_passes_check_config():
    from bot.cli import main

    assert main(["check-config", str(DEPLOY / "eagle3.example.toml")]) == 0


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / "eagle3.service").read_text())
    return parser


def test_systemd_unit_runs_serve_and_never_kills_the_stages():
    u = unit()
    assert set(u.sections()) == {"Unit", "Service", "Install"}
    service = u["Service"]
    assert re.fullmatch(r"/\S+/eagle3 serve( --\S+ \S+)*", service["ExecStart"])
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "process"
    assert service["EnvironmentFile"].startswith("/")
    text = (DEPLOY / "eagle3.service").read_text()
    before = text[: text.index("\nKillMode=process")].splitlines()
    why = " ".join(line for line in before[-8:] if line.startswith("#"))  # the comment just above it
    assert "stages" in why and "restart" in why, "the unit says why KillMode=process"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert not SECRETS & set(text.split("=")), "no secret values in the unit"


def test_env_template_names_every_secret_without_values_and_says_mode_600():
    text = (DEPLOY / "eagle3.env.example").read_text()
    assignments = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert set(assignments) == SECRETS
    assert all(v == "" for v in assignments.values()), "the template holds no secret"
    assert "install -m 600" in text


def test_slack_manifest():
    m = yaml.safe_load((DEPLOY / "slack-manifest.yaml").read_text())
    commands = m["features"]["slash_commands"]
    assert [c["command"] for c in commands] == ["/eagle3"]
    for usage in SUBCOMMANDS:
        assert usage.split()[0] in commands[0]["usage_hint"]
    assert sorted(m["oauth_config"]["scopes"]["bot"]) == ["chat:write", "commands"]
    assert m["settings"]["interactivity"]["is_enabled"] is True
    assert m["settings"]["socket_mode_enabled"] is True
    assert m["display_information"]["name"] and m["features"]["bot_user"]["display_name"]
