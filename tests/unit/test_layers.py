"""Imports flow one way: bot -> handlers -> pipeline."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "pipeline": {"bot", "handlers", "slack_bolt", "slack_sdk"},
    "handlers": {"bot"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_upward(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_scanner_sees_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import slack_sdk.web\nfrom bot.cli import main\nif True:\n    import handlers\n")
    assert imported_roots(sample) == {"slack_sdk", "bot", "handlers"}


def test_status_path_does_not_import_torch():
    import subprocess
    import sys
    code = ("import sys, bot.cli, pipeline.controller, handlers.views; "
            "print(sorted(m for m in ('torch', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
