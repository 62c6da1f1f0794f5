"""`eagle3 serve --metrics-port P`: the pipeline's state in Prometheus' text format at `/metrics`.

Every scrape reads the store (what `eagle3 status` reads, without sampling: the monitor keeps
it current), so the numbers are the ones Slack and the CLI show. A stage with no reading has
no sample for that metric — never a 0 that would read as "no progress".
"""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from pipeline.config import Workspace
from pipeline.states import HandoffStep
from pipeline.verdict import VERDICTS

log = logging.getLogger("eagle3.metrics")
# a cancelled handoff reads "off" (auto-start is off again)
HANDOFF_STEPS = ("off", *(str(s) for s in HandoffStep if s is not HandoffStep.CANCELLED))


class StoreCollector:
    """A prometheus_client collector over the workspace's store."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from pipeline.controller import Controller

        ctl = Controller(workspace=self.ws, check_integrity=False)
        try:
            st = ctl.status(sample_if_unmonitored=False)
            tick = ctl.last_tick()
            restarts = {stage: ctl.restarts(stage) for stage in st.stages}
        finally:
            ctl.close()
        g = {name: GaugeMetricFamily(name, doc, labels=labels) for name, doc, labels in (
            ("eagle3_stage_progress_ratio", "Share of the stage's work done (0–1), from its own progress authority.",
             ["stage"]),
            ("eagle3_stage_eta_seconds", "Seconds the stage is estimated to need still (absent when withheld).",
             ["stage"]),
            ("eagle3_stage_verdict", "1 for the stage's current verdict, 0 for the others.", ["stage", "verdict"]),
            ("eagle3_stage_last_progress_timestamp_seconds", "Unix time of the stage's last progress.", ["stage"]),
            ("eagle3_stage_up", "1 while the stage's process is running, 0 otherwise.", ["stage"]),
            ("eagle3_handoff_step", "1 for the auto-start handoff's current step, 0 for the others.", ["step"]),
            ("eagle3_stage_disk_fits", "1 when what the stage still has to write fits in the free space of its "
             "output's filesystem, 0 when it will not.", ["stage"]),
            ("eagle3_stage_disk_need_bytes", "Bytes the stage is projected still to write.", ["stage"]),
            ("eagle3_stage_disk_free_bytes", "Free bytes on the filesystem of the stage's output.", ["stage"]),
        )}
        for stage, s in st.stages.items():
            if s.progress_pct is not None:
                g["eagle3_stage_progress_ratio"].add_metric([stage], s.progress_pct / 100.0)
            if s.eta_s is not None:
                g["eagle3_stage_eta_seconds"].add_metric([stage], s.eta_s)
            if s.verdict:
                for v in VERDICTS:
                    g["eagle3_stage_verdict"].add_metric([stage, v], 1.0 if v == s.verdict else 0.0)
            if s.last_progress_at:
                g["eagle3_stage_last_progress_timestamp_seconds"].add_metric([stage], s.last_progress_at)
            g["eagle3_stage_up"].add_metric([stage], 1.0 if s.running else 0.0)
            disk = s.disk or {}
            if isinstance(disk.get("fits"), bool):  # absent while the need is unknown (no rate, no first checkpoint)
                g["eagle3_stage_disk_fits"].add_metric([stage], 1.0 if disk["fits"] else 0.0)
                g["eagle3_stage_disk_need_bytes"].add_metric([stage], float(disk.get("need_bytes") or 0))
            if isinstance(disk.get("free_bytes"), (int, float)):
                g["eagle3_stage_disk_free_bytes"].add_metric([stage], float(disk["free_bytes"]))
        step = st.autostart or "off"
        for name in HANDOFF_STEPS if step in HANDOFF_STEPS else (*HANDOFF_STEPS, step):
            g["eagle3_handoff_step"].add_metric([name], 1.0 if name == step else 0.0)
        yield from g.values()
        yield from _counters(st, restarts)
        outbox = GaugeMetricFamily("eagle3_outbox_messages", "Outgoing Slack messages by state (pending: not "
                                   "delivered yet; failed: given up on).", labels=["state"])
        for state in ("pending", "failed"):
            outbox.add_metric([state], float(st.outbox.get(state) or 0))
        yield outbox
        if tick is not None:  # absent, never 0, when the monitor has never ticked or stopped cleanly
            beat = GaugeMetricFamily("eagle3_monitor_last_tick_timestamp_seconds",
                                     "Unix time of the monitor's last tick: a hung monitor serves old numbers.")
            beat.add_metric([], tick)
            yield beat
        prog = st.stages["train"].progress or {}
        for key, doc in (("loss", "The trainer's last logged loss."), ("kl", "The trainer's last logged KL."),
                         ("tau", "The simulated acceptance length τ = 1 + Σ Π top-1 by depth at the trainer's last "
                                 "validation.")):
            if isinstance(prog.get(key), (int, float)):
                m = GaugeMetricFamily(f"eagle3_train_{key}", doc)
                m.add_metric([], float(prog[key]))
                yield m
        train = st.stages["train"]
        if train.done is not None and (prog.get("unit") in (None, "steps")):
            m = GaugeMetricFamily("eagle3_train_step", "The trainer's last logged step.")
            m.add_metric([], float(train.done))
            yield m


def _counters(st, restarts: dict[str, dict[str, int]]):
    """Totals of the current run: samples done and failed, tokens, restarts (reset by a new run)."""
    from prometheus_client.core import CounterMetricFamily

    samples = CounterMetricFamily("eagle3_samples", "Samples processed by the stage in this run.",
                                  labels=["stage", "status"])
    tokens = CounterMetricFamily("eagle3_tokens", "Prompt tokens processed by the stage in this run.", labels=["stage"])
    restarted = CounterMetricFamily("eagle3_stage_restarts", "Restarts of the stage in this run, by its on-failure "
                                    "policy (by=policy) or asked for by a person (by=hand).", labels=["stage", "by"])
    for stage, s in st.stages.items():
        prog = s.progress or {}
        if prog.get("unit", "samples") == "samples" and s.done is not None:
            samples.add_metric([stage, "done"], float(s.done))
            samples.add_metric([stage, "failed"], float(s.failed or 0))
        if isinstance(prog.get("tokens_done"), (int, float)):
            tokens.add_metric([stage], float(prog["tokens_done"]))
        for by, n in (restarts.get(stage) or {"policy": 0, "hand": 0}).items():
            restarted.add_metric([stage, by], float(n))
    yield from (samples, tokens, restarted)


def _build_info(docs: str | None = None):
    from importlib.metadata import PackageNotFoundError, version

    from prometheus_client.core import GaugeMetricFamily

    try:
        ours = version("eagle3-ops")
    except PackageNotFoundError:
        ours = "unknown"
    import platform

    info = GaugeMetricFamily("eagle3_build_info", "Always 1; the version, the source revision, Python and the docs' "
                             "base URL (the alert rules' runbook links) in labels.",
                             labels=["version", "revision", "python", "docs_url"])
    info.add_metric([ours, revision(), platform.python_version(), docs or docs_url()], 1.0)
    return info


HERE = Path(__file__).resolve().parent.parent  # the checkout or install this code runs from


@functools.cache
def docs_url() -> str:
    """The docs' base URL: the checkout's repository web view at its revision, else the install's docs/ as a
    file URL. Read once (a scrape runs no git)."""
    return web_docs_url(_git("remote", "get-url", "origin"), revision().split("-")[0]) or (HERE / "docs").as_uri()


def web_docs_url(remote: str | None, rev: str) -> str | None:
    """docs/ in the web view of a git remote (https or ssh, GitHub- or GitLab-style) at `rev`; None for a local
    path or an unknown revision. Credentials in an https remote are never carried over."""
    m = re.fullmatch(r"(?:https?://(?:[^@/]+@)?|ssh://(?:[^@/]+@)?|[^@/]+@)([^/:]+)[:/](.+?)(?:\.git)?/?",
                     remote or "")
    if not m or not rev or rev == "unknown":
        return None
    web = f"https://{m.group(1)}/{m.group(2)}"
    return f"{web}/{'-/' if 'gitlab' in m.group(1) else ''}blob/{rev}/docs"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


@functools.cache
def revision() -> str:
    """The source revision this install runs: the git commit of its checkout (an editable install, as
    deploy/eagle3.service's), else the commit pip recorded for a VCS install (direct_url.json), else "unknown".
    Read once."""
    import json
    from importlib.metadata import PackageNotFoundError, distribution

    head = _git("rev-parse", "--short=12", "HEAD")
    if head:
        return head + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    try:
        direct = json.loads(distribution("eagle3-ops").read_text("direct_url.json") or "{}")
        return (direct.get("vcs_info") or {}).get("commit_id", "unknown")[:12]
    except (PackageNotFoundError, ValueError):
        return "unknown"


class BuildInfo:
    def __init__(self, docs: str | None = None) -> None:
        self.docs = docs

    def collect(self):
        yield _build_info(self.docs)


class _Threaded(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, fmt, *args):
        log.debug("metrics: " + fmt, *args)


def serve_metrics(ws: Workspace, *, host: str, port: int):
    """Start /metrics in a thread; returns the server (`.server_address`, `.shutdown()`)."""
    from prometheus_client import (
        CollectorRegistry,
        PlatformCollector,
        ProcessCollector,
        make_wsgi_app,
    )

    registry = CollectorRegistry()
    registry.register(StoreCollector(ws))
    registry.register(BuildInfo(ws.config.metrics.docs_url))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, …
    PlatformCollector(registry=registry)  # python_info
    server = make_server(host, port, make_wsgi_app(registry), server_class=_Threaded, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="eagle3-metrics", daemon=True).start()
    return server
