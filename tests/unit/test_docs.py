"""Docs checked by tests (the sqlite-utils way): every CLI subcommand and every slash
subcommand is documented and has help text."""

from pathlib import Path

import pytest

from bot.cli import COMMANDS, PASSTHROUGH, build_parser, main
from handlers.verbs import HELP, SUBCOMMANDS, parse
from pipeline.verdict import VERDICTS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
OPERATOR = (ROOT / "docs" / "operator.md").read_text()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_documented_and_has_help(name, capsys):
    assert f"`eagle3 {name}" in README, f"README does not document `eagle3 {name}`"
    assert COMMANDS[name]
    with pytest.raises(SystemExit) as exit_:
        if name in PASSTHROUGH:  # its flags and its --help are the program's it runs (the trainer's)
            main([name, "--help"])
        else:
            build_parser().parse_args([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: eagle3 {name}")
    assert f"Example: {COMMANDS[name].example}" in out  # each command's help shows it in use


@pytest.mark.parametrize("usage", list(SUBCOMMANDS))
def test_slash_subcommand_documented_and_in_help(usage):
    documented = usage.replace("|", "\\|")  # as written inside a Markdown table
    assert f"`/eagle3 {documented}`" in OPERATOR, f"docs/operator.md does not document `/eagle3 {usage}`"
    assert f"`{usage}`" in HELP and SUBCOMMANDS[usage]
    verb = usage.split()[0]
    arg = usage.split()[1].split("|")[0] if " " in usage else ""
    assert parse(f"{verb} {arg}".strip())[0] != "help" or verb == "help", f"`{usage}` is documented but not parsed"


def test_readme_shows_the_two_commands_and_links_the_operator_guide():
    assert "make demo" in README and "make test" in README
    assert "(docs/operator.md)" in README


def test_operator_guide_covers_a_first_day():
    for heading in ("## 1. Install on the GPU host", "## 2. Create the Slack app from the manifest",
                    "## 4. Run under systemd", "## 7. Verdicts and what to do", "## 8. The handoff",
                    "### The GPUs look idle: is it stuck?", "### The server's request counter is ahead of the samples"):
        assert heading in OPERATOR
    troubleshooting = OPERATOR[OPERATOR.index("## 9. Troubleshooting"):]
    assert troubleshooting.index("GPUs look idle") < troubleshooting.index("request counter is ahead")
    for anchor in ("#6-slash-commands",):
        assert anchor in README
    for path in ("deploy/slack-manifest.yaml", "deploy/eagle3.env.example", "deploy/eagle3.service",
                 "deploy/eagle3.example.toml"):
        assert (ROOT / path).exists() and path in OPERATOR


@pytest.mark.parametrize("verdict", VERDICTS)
def test_every_verdict_says_what_to_do(verdict):
    for doc in (README, OPERATOR):
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{verdict}` |")), None)
        assert row and len(row.split("|")) >= 5 and row.split("|")[3].strip(), f"no row for `{verdict}`"


def _guide_commands() -> list[list[str]]:
    """Every `eagle3 …` line in the guide's shell blocks, as argv (comments dropped)."""
    import shlex

    commands, fence = [], None  # fence: the open block's info string ("" for a shell block)
    for line in OPERATOR.splitlines():
        if line.startswith("```"):
            fence = line[3:] if fence is None else None
            continue
        if fence == "" and line.startswith("eagle3 "):
            commands.append(shlex.split(line.split(" #")[0])[1:])
    return commands


def test_the_guides_commands_parse():
    commands = _guide_commands()
    assert len(commands) >= 6 and ["check-config"] in commands
    for argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 0, f"the guide shows `eagle3 {' '.join(argv)}`, which eagle3 refuses"


@pytest.mark.timeout(90)
def test_the_guides_journal_lines_are_what_serve_prints(tmp_path):
    import os
    import re
    import socket
    import subprocess
    import sys

    blocks = re.findall(r"```journal\n(.*?)```", OPERATOR, flags=re.S)
    start_line, connected = blocks[0].strip().splitlines()
    retry_line, = blocks[1].strip().splitlines()
    subprocess.run([sys.executable, "-m", "bot.cli", "init", "--demo", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True)
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(cfg.read_text().replace("tick_s = 1", "tick_s = 10") + '\n[slack]\nchannel = "C0123456789"\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k != "EAGLE3_CONFIG"}, "SLACK_BOT_TOKEN": "xoxb-docs",
           "SLACK_APP_TOKEN": "xapp-docs", "SLACK_API_URL": f"http://127.0.0.1:{closed}/api/"}
    out = subprocess.run([sys.executable, "-m", "bot.cli", "serve", "--max-ticks", "1", "--config", str(cfg)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    printed = out.stdout.splitlines() + out.stderr.splitlines()
    assert start_line.replace("/data/eagle3/eagle3.toml", str(cfg)) in printed, printed
    assert connected == "INFO eagle3.service: slack: Socket Mode connected"  # needs a reachable Slack: check the source
    assert 'log.info("slack: Socket Mode connected")' in (ROOT / "bot" / "service.py").read_text()
    head, tail = retry_line.split(" (", 1)[0], retry_line.rsplit(";", 1)[1]
    assert any(line.startswith(head + " (URLError:") and line.endswith(tail) for line in printed), printed


def test_the_architecture_page_names_only_modules_that_exist():
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:bot|handlers|pipeline|tests)/[\w/]*\w(?:\.py)?/?)", text))
    assert len(named) >= 20, "the page names the modules of each layer"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"
    assert "(docs/architecture.md)" in README
