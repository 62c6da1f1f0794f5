"""`serve --metrics-port`: a scrape parses with prometheus_client's parser and says what the store says."""

from __future__ import annotations

import json
import re
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bot.metrics import serve_metrics
from pipeline.config import load_workspace
from pipeline.controller import Controller
from tests.conftest import ROOT, eagle3, wait_for
from tests.scenario.slack_kit import extracted_workspace

pytestmark = pytest.mark.timeout(120)


def scrape(url: str) -> dict[tuple, float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_scrape_has_the_values_the_store_says(tmp_path):
    cfg = extracted_workspace(tmp_path, "40", "0", train_extra='out = "ckpt"\n')
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "progress.jsonl").write_text('{"step": 3, "total_steps": 10, "loss": 2.5, "kl": 0.25}\n')
    assert eagle3("start", "train", "--force", "--config", str(cfg)).returncode == 0
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    server = serve_metrics(ws, host="127.0.0.1", port=0)
    try:
        wait_for(lambda: ctl.status().stages["train"].progress, what="a training reading")
        st = ctl.status(sample_if_unmonitored=False).to_json()
        m = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        ex, tr = st["stages"]["extract"], st["stages"]["train"]
        assert m[("eagle3_stage_progress_ratio", (("stage", "extract"),))] == pytest.approx(ex["progress_pct"] / 100)
        assert m[("eagle3_stage_verdict", (("stage", "extract"), ("verdict", ex["verdict"])))] == 1.0
        assert sum(v for (name, labels), v in m.items()
                   if name == "eagle3_stage_verdict" and ("stage", "extract") in labels) == 1.0
        assert m[("eagle3_stage_up", (("stage", "extract"),))] == 0.0
        assert m[("eagle3_stage_up", (("stage", "train"),))] == (1.0 if tr["state"] == "running" else 0.0)
        assert m[("eagle3_train_loss", ())] == 2.5 and m[("eagle3_train_kl", ())] == 0.25
        assert m[("eagle3_outbox_messages", (("state", "pending"),))] == float(st["outbox"]["pending"])
        assert ("eagle3_slack_outbox_pending", ()) not in m  # one metric for one fact
        assert m[("eagle3_handoff_step", (("step", "off"),))] == 1.0
        # a stage never started has no progress sample: unknown is absent, never a 0
        assert not any(name == "eagle3_stage_progress_ratio" and ("stage", "server") in labels for name, labels in m)
        if ex.get("last_progress_at"):
            assert m[("eagle3_stage_last_progress_timestamp_seconds", (("stage", "extract"),))] == ex["last_progress_at"]
        # issue 35: counters of the run, the step, the monitor's heartbeat, the outbox, build and process facts
        assert m[("eagle3_samples_total", (("stage", "extract"), ("status", "done")))] == float(ex["done"])
        assert m[("eagle3_samples_total", (("stage", "extract"), ("status", "failed")))] == float(ex["failed"] or 0)
        assert m[("eagle3_tokens_total", (("stage", "extract"),))] > 0
        assert m[("eagle3_stage_restarts_total", (("by", "policy"), ("stage", "extract")))] == 0.0
        assert m[("eagle3_stage_restarts_total", (("by", "hand"), ("stage", "extract")))] == 0.0
        disk = ex.get("disk") or {}
        if disk.get("free_bytes") is not None:  # the disk reading of the stage's output, unknown fields absent
            assert m[("eagle3_stage_disk_free_bytes", (("stage", "extract"),))] == float(disk["free_bytes"])
        assert (("eagle3_stage_disk_fits", (("stage", "extract"),)) in m) == isinstance(disk.get("fits"), bool)
        assert m[("eagle3_train_step", ())] == 3.0
        assert ("eagle3_monitor_last_tick_timestamp_seconds", ()) not in m  # no monitor: absent, never 0
        assert m[("eagle3_outbox_messages", (("state", "failed"),))] == float(st["outbox"]["failed"])
        info = [labels for (name, labels), v in m.items() if name == "eagle3_build_info" and v == 1.0]
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        assert len(info) == 1 and dict(info[0])["revision"].split("-")[0] == head.stdout.strip(), info
        assert dict(info[0])["docs_url"].endswith("/docs"), info  # the runbook links' base (a file URL here)
        assert m[("process_resident_memory_bytes", ())] > 0 and ("python_info" in {n for n, _ in m})
        ctl.store.put("monitor", {"pid": 1, "t": 1_790_000_000.0, "tick_s": 10})  # a heartbeat, as serve stores it
        m = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        assert m[("eagle3_monitor_last_tick_timestamp_seconds", ())] == 1_790_000_000.0
        # the shipped alert rules and dashboard use only metrics a scrape carries
        rules = (ROOT / "deploy" / "prometheus" / "eagle3-alerts.yml").read_text().replace(
            "eagle3_docs_url", "")  # an external label Prometheus' own config sets, not a metric
        board = json.loads((ROOT / "deploy" / "grafana" / "eagle3.json").read_text())
        exprs = [rules] + [t["expr"] for p in board["panels"] for t in p["targets"]]
        used = {n for e in exprs for n in re.findall(r"\b(?:eagle3|process|python)_[a-z_]+\b", e)}
        assert used and used <= {name for name, _ in m}, used - {name for name, _ in m}
    finally:
        server.shutdown()
        ctl.close()
        eagle3("stop", "--all", "--grace", "1", "--config", str(cfg))
