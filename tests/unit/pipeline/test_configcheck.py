"""`eagle3 check-config` finds what parses but would fail hours later, one line each."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from bot.cli import main
from pipeline.config import load_workspace
from pipeline.configcheck import SERVICE_PATH, problems
from pipeline.templates import production_template

GOOD = """
[slack]
channel = "C0123456789"
allowed_user_ids = ["U0123456789"]

[stages.server]
argv = ["{python}", "-m", "bot.cli", "toy-server", "--port", "30000"]
url = "http://127.0.0.1:30000"
port = 30000

[stages.extract]
argv = ["{python}", "-m", "bot.cli", "extract", "--server", "http://127.0.0.1:30000", "--data", "data.jsonl",
        "--out", "out"]
data = "data.jsonl"
out = "out"

[stages.train]
argv = ["{python}", "-m", "pipeline.train", "--data", "out", "--out", "ckpt", "--steps", "5"]
out = "ckpt"
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "data.jsonl").write_text('{"input_ids": [1, 2]}\n')
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(text.replace("{python}", sys.executable))
    return cfg


def test_a_good_config_has_no_problem(tmp_path, capsys):
    cfg = write(tmp_path, GOOD)
    assert problems(load_workspace(cfg)) == []
    assert main(["check-config", str(cfg)]) == 0 and "ok" in capsys.readouterr().out


@pytest.mark.parametrize(("old", "new", "expected"), [
    ('channel = "C0123456789"', 'channel = "#eagle3-ops"',
     'slack.channel: "#eagle3-ops" is not a Slack id; Slack wants a channel id such as C0123456789'),
    ('allowed_user_ids = ["U0123456789"]', 'allowed_user_ids = ["@alice"]',
     'slack.allowed_user_ids: "@alice" is not a Slack id; Slack wants member ids such as U0123456789'),
    ("port = 30000\n", "port = 30001\n",
     "stages.server.port: 30001, but stages.server.url (http://127.0.0.1:30000) points at port 30000"),
    ('"toy-server", "--port", "30000"', '"toy-server", "--port", "30002"',
     "stages.server.argv: the server is started with --port 30002, but stages.server.port is 30000"),
    ('out = "out"', 'out = "elsewhere"',
     'stages.extract.out: "elsewhere", but the command is given --out "out"'),
    ('data = "data.jsonl"', 'data = "missing.jsonl"', 'stages.extract.data: "missing.jsonl" does not exist'),
    ('out = "ckpt"', 'out = "ckpt2"', 'stages.train.out: "ckpt2", but the command is given --out "ckpt"'),
    ('argv = ["{python}", "-m", "pipeline.train"', 'argv = ["torchrun", "-m", "pipeline.train"',
     "stages.train.argv[0]: \"torchrun\" is not on the service's PATH"),
    ('argv = ["{python}", "-m", "bot.cli", "toy-server"', 'argv = ["/nonexistent/python", "-m", "bot.cli", "toy-server"',
     'stages.server.argv[0]: "/nonexistent/python" does not exist'),
    ('channel = "C0123456789"', 'channel = "<SLACK_CHANNEL_ID>"',
     "slack.channel: still holds the placeholder <SLACK_CHANNEL_ID>; replace it"),
])
def test_each_problem_is_one_line_naming_the_key(tmp_path, capsys, old, new, expected):
    assert old in GOOD
    cfg = write(tmp_path, GOOD.replace(old, new))
    assert main(["check-config", str(cfg)]) == 2
    *found, summary = capsys.readouterr().err.strip().splitlines()
    assert any(expected in line for line in found), found
    assert all(line.startswith("eagle3: eagle3.toml: ") for line in found)
    assert summary.endswith(f"{len(found)} problem(s); fix them and run `eagle3 check-config` again")
    # a port or a data path that disagrees is also at odds with the argv or the url: two lines then
    assert len(found) == (2 if new in ("port = 30001\n", 'data = "missing.jsonl"') else 1), found


def test_the_untouched_template_is_refused_with_every_placeholder(tmp_path, capsys):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(production_template())
    assert main(["check-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    for name in ("<SGLANG_VENV>", "<MODEL_PATH>", "<DATA_JSONL>", "<EXTRACT_OUT>", "<CKPT_DIR>", "<STEPS>",
                 "<SLACK_CHANNEL_ID>"):
        assert f"still holds the placeholder {name}" in err


def test_init_writes_stage_commands_that_a_service_finds(tmp_path):
    """The template's programs are this install's, by absolute path: the service's PATH has no venv."""
    ws_cfg = tmp_path / "eagle3.toml"
    ws_cfg.write_text(production_template())
    ws = load_workspace(ws_cfg)
    here = Path(sys.executable).parent
    assert ws.stage("extract").argv[0] == str(here / "eagle3")
    assert ws.stage("train").argv[0] == str(here / "torchrun")
    assert "--token-budget" in ws.stage("train").argv
    assert [p for p in problems(ws) if "argv[0]" in p and "placeholder" not in p] == []


def test_a_stage_env_path_is_the_one_looked_up(tmp_path):
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    text = GOOD.replace('argv = ["{python}", "-m", "pipeline.train"', 'argv = ["mytool", "-m", "pipeline.train"')
    cfg = write(tmp_path, text)
    assert any("mytool" in p for p in problems(load_workspace(cfg), path_env=SERVICE_PATH))
    cfg.write_text(cfg.read_text().replace('out = "ckpt"', f'out = "ckpt"\nenv = {{ PATH = "{tool.parent}" }}'))
    assert problems(load_workspace(cfg)) == []
