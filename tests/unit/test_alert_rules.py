"""The shipped Prometheus rules (issue 35): `promtool check rules` and `promtool test rules` pass, every alert
carries severity, summary and a runbook link into the operator guide. promtool comes from Debian's
`prometheus` package: installed here as root when missing (CI runs as root)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "eagle3-alerts.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "eagle3-alerts.test.yml"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def promtool(tmp_path_factory) -> str:
    found = shutil.which("promtool")
    if found:
        return found
    assert os.geteuid() == 0, "promtool is missing and this is not root: apt-get install prometheus"
    from filelock import FileLock

    with FileLock(str(tmp_path_factory.getbasetemp().parent / "promtool-install.lock")):
        if not shutil.which("promtool"):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            res = subprocess.run(["apt-get", "install", "-y", "-q", "prometheus"], capture_output=True, text=True,
                                 env=env, timeout=240)
            if res.returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=240)
                res = subprocess.run(["apt-get", "install", "-y", "-q", "prometheus"], capture_output=True,
                                     text=True, env=env, timeout=240)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return shutil.which("promtool")


def test_promtool_checks_and_unit_tests_the_rules(promtool):
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 8 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True,
                          text=True, timeout=60)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_has_severity_summary_and_a_runbook_into_the_guide():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    tested = yaml.safe_load(RULE_TESTS.read_text())
    anchors = {slug(line.lstrip("#")) for line in (ROOT / "docs" / "operator.md").read_text().splitlines()
               if line.startswith("#")}
    names = {r["alert"] for r in rules}
    assert {"Eagle3StageStalled", "Eagle3StageDead", "Eagle3BotAbsent", "Eagle3MonitorNotTicking",
            "Eagle3SlackOutboxStuck", "Eagle3NoProgress", "Eagle3TrainNoSteps", "Eagle3SlackMessagesFailed"} == names
    for r in rules:
        assert r["labels"]["severity"] in ("page", "warning"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        url = r["annotations"]["runbook_url"]  # a base from the external label or the bot's docs_url, else docs/
        assert "$externalLabels.eagle3_docs_url" in url and ".Labels.docs_url" in url, url
        assert url.split("}}")[-1].startswith("/operator.md#") and url.split("#", 1)[1] in anchors, url
    fired = {t["alertname"] for case in tested["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == names  # each alert is unit-tested firing


@pytest.mark.parametrize("remote, url", [
    ("git@github.com:org/eagle3-ops.git", "https://github.com/org/eagle3-ops/blob/abc123/docs"),
    ("https://user:token@github.com/org/eagle3-ops.git", "https://github.com/org/eagle3-ops/blob/abc123/docs"),
    ("ssh://git@gitlab.example.com/ml/eagle3-ops.git", "https://gitlab.example.com/ml/eagle3-ops/-/blob/abc123/docs"),
    ("/srv/git/eagle3-ops", None), (None, None)])
def test_the_runbook_base_is_the_checkouts_repository_web_view_without_credentials(remote, url):
    from bot.metrics import web_docs_url

    assert web_docs_url(remote, "abc123") == url
    assert web_docs_url(remote, "unknown") is None


def test_the_dashboard_filters_by_host_colours_verdicts_and_marks_stalls_and_handoffs(promtool, tmp_path):
    """deploy/grafana/eagle3.json: an `instance` variable every eagle3 query honours (two hosts are never merged),
    a value mapping with a colour for every verdict and handoff step, annotations for stalls, handoff steps and
    restarts — and every query is PromQL that Prometheus parses (checked by promtool as recording rules)."""
    import json

    from bot.metrics import HANDOFF_STEPS
    from pipeline.verdict import VERDICTS

    board = json.loads((ROOT / "deploy" / "grafana" / "eagle3.json").read_text())
    assert any(v["name"] == "instance" for v in board["templating"]["list"])
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]] + [
        a["expr"] for a in board["annotations"]["list"]]
    for e in exprs:
        for selector in re.findall(r"\b(?:eagle3_[a-z_]+|up|process_[a-z_]+)(\{[^}]*\})?", e):
            assert 'instance=~"$instance"' in selector, e
    panels = {p["title"]: p for p in board["panels"]}
    for title, values in (("Verdict", VERDICTS), ("Handoff step", HANDOFF_STEPS)):
        options = panels[title]["fieldConfig"]["defaults"]["mappings"][0]["options"]
        assert sorted(o["text"] for o in options.values()) == sorted(values), title
        assert all(o.get("color") for o in options.values()), title
    colours = {o["text"]: o["color"] for o in panels["Verdict"]["fieldConfig"]["defaults"]["mappings"][0]["options"].values()}
    assert colours["stalled"] != colours["progressing"]
    names = {a["name"] for a in board["annotations"]["list"]}
    assert {"Stalls and deaths", "Handoff", "Restarts"} <= names
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e.replace("$instance", ".*")} for i, e in enumerate(exprs)]}]}
    f = tmp_path / "dashboard-queries.yml"
    f.write_text(yaml.safe_dump(rules))
    check = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
