"""Docs checked by tests (the sqlite-utils way): every CLI subcommand and every slash
subcommand is documented and has help text."""

from pathlib import Path

import pytest

from bot.cli import COMMANDS, build_parser
from handlers.slash import HELP, SUBCOMMANDS, parse
from pipeline.verdict import VERDICTS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
OPERATOR = (ROOT / "docs" / "operator.md").read_text()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_documented_and_has_help(name, capsys):
    assert f"`eagle3 {name}" in README, f"README does not document `eagle3 {name}`"
    assert COMMANDS[name]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: eagle3 {name}")


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
