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
