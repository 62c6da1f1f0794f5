"""Docs checked by tests: every CLI subcommand is documented in the README and has help."""

from pathlib import Path

import pytest

from bot.cli import COMMANDS, build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_documented_and_has_help(name, capsys):
    assert f"`eagle3 {name}" in README, f"README does not document `eagle3 {name}`"
    assert COMMANDS[name]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: eagle3 {name}")


def test_readme_shows_the_two_commands():
    assert "make demo" in README and "make test" in README
