"""Small things an operator meets at the terminal: pipes, refusals, a template left unfilled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.templates import production_template
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(60)


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_CONFIG"}
    return subprocess.run([sys.executable, "-m", "bot.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, **kw)


def test_a_closed_pipe_is_not_an_error(tmp_path):
    """`eagle3 … | head`: the reader went away; no 'unexpected error … please report it'."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": 1790000000.0 + i, "stage": "extract", "progress": {
        "done": i, "total": 5000}}) + "\n" for i in range(3000)))
    r, w = os.pipe()
    os.close(r)  # like `| head` that has already exited
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_CONFIG"}
    proc = subprocess.run([sys.executable, "-m", "bot.cli", "diagnose", "--replay", str(trace), "--json"], cwd=ROOT,
                          env=env, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(w)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_serve_refuses_a_template_with_placeholders(tmp_path):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(production_template())
    out = run("serve", "--max-ticks", "1", "--config", str(cfg))
    assert out.returncode == 2, out.stdout + out.stderr
    line, = out.stderr.strip().splitlines()
    assert "still holds the placeholder <SGLANG_VENV>" in line and "placeholder(s) left" in line
    assert "serve refuses a config that is not filled in" in line
    assert not (tmp_path / ".eagle3" / "serve.lock").exists() or "monitoring" not in out.stdout


def test_status_works_on_the_untouched_template(tmp_path):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(production_template())
    out = run("status", "--config", str(cfg))
    assert out.returncode == 0 and out.stdout.startswith("run: none open"), out.stderr


def test_the_audit_names_the_person_behind_sudo():
    from bot.cli import cli_user

    assert cli_user({"SUDO_USER": "ana", "USER": "eagle3"}, 999) == "ana"
    assert cli_user({"USER": "eagle3"}, 999) == "eagle3"
    assert cli_user({}, 0) == "root", "no cli:0: the account's name"


def test_root_is_refused_in_a_workspace_another_account_owns(tmp_path):
    from pipeline.controller import refuse_foreign_root
    from pipeline.errors import UserError

    state = tmp_path / ".eagle3"
    state.mkdir()
    refuse_foreign_root(state, euid=0, env={})  # root's own workspace: fine
    os.chown(state, 65534, 65534) if os.geteuid() == 0 else pytest.skip("chown needs root")
    with pytest.raises(UserError, match=r"belongs to nobody, but this command runs as root.*sudo -u nobody eagle3"):
        refuse_foreign_root(state, euid=0, env={})
    refuse_foreign_root(state, euid=0, env={"EAGLE3_ALLOW_ROOT": "1"})
    refuse_foreign_root(state, euid=65534, env={})


def documented_commands() -> list[list[str]]:
    """Every `eagle3 …`, `torchrun … -m pipeline.train …` line of the README's and the operator guide's
    code blocks, as argv (optional `[…]` parts and comments dropped)."""
    import re
    import shlex

    found = []
    for name in ("README.md", "docs/operator.md"):
        for block in re.findall(r"```[a-z]*\n(.*?)```", (ROOT / name).read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", re.sub(r"\[[^\]]*\]", "", line)).strip()
                line = re.sub(r"^(sudo -u \S+ |CUDA_VISIBLE_DEVICES=\S+ )+", "", line)
                line = re.sub(r"(?<=\s)N(?=\s|$)", "1", line)  # a synopsis' count placeholder
                if line.startswith("eagle3 ") and not line.startswith("eagle3 serve:"):
                    found.append(shlex.split(line)[1:])
                elif " -m pipeline.train " in line:
                    found.append(["train", *shlex.split(line.split(" -m pipeline.train ", 1)[1])])
    return found


def test_the_documented_commands_parse_as_written():
    """Issue 30: `eagle3 train --data X --out Y --steps 1` from the README failed with 'unrecognized
    arguments'. Every documented command line parses, the trainer's through the trainer's parser."""
    from bot.cli import PASSTHROUGH, build_parser
    from pipeline.train.loop import parser as train_parser

    commands = documented_commands()
    assert any(c[0] == "train" for c in commands) and any(c[0] == "start" for c in commands)
    for argv in (c for c in commands if "--help" not in c):
        args, extra = build_parser().parse_known_args(argv)
        if args.command in PASSTHROUGH:
            train_parser().parse_args(extra)
        else:
            assert not extra, (argv, extra)


def test_serve_logs_no_library_request_lines_at_info():
    import logging

    from bot.cli import configure_logging

    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        configure_logging(logging.INFO)
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("eagle3.service").isEnabledFor(logging.INFO)
        configure_logging(logging.DEBUG)
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG), "debug shows the libraries too"
    finally:
        for name in ("httpx", "httpcore", "urllib3", "apscheduler", "slack_bolt", "slack_sdk", "eagle3"):
            logging.getLogger(name).setLevel(logging.NOTSET)
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


def test_diagnose_json_live_is_json(tmp_path):
    """`eagle3 diagnose --json` without --replay: each stage's verdict as JSON, not the text of `diagnose`."""
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[stages.extract]\nargv = ["x"]\n')
    out = run("diagnose", "--json", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    stages = json.loads(out.stdout)
    assert set(stages) >= {"server", "extract", "train"}
    assert stages["extract"]["state"] == "not-started" and stages["extract"]["verdict"] is None


def test_slack_library_errors_during_an_outage_are_said_once_per_window():
    import logging

    from bot.cli import OncePerWindow

    now = [0.0]
    f = OncePerWindow(prefixes=("slack_sdk",), window_s=300, clock=lambda: now[0])

    def record(name, msg):
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None)

    passed = []
    for i in range(12):  # a minute of failed retries, 5 s apart
        now[0] = 5.0 * i
        r = record("slack_sdk.web.base_client", f"Failed to send a request to Slack API server: attempt {i}")
        if f.filter(r):
            passed.append(r.getMessage())
    assert passed == ["Failed to send a request to Slack API server: attempt 0"]
    assert f.filter(record("eagle3.notifier", "delivery failed")), "eagle3's own lines are never held back"
    now[0] = 400.0
    r = record("slack_sdk.web.base_client", "Failed to send a request to Slack API server: attempt 80")
    assert f.filter(r) and "11 more like it in the last 5 min held back" in r.getMessage()
