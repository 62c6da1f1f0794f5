"""`eagle3 serve --metrics-port P`: the pipeline's state in Prometheus' text format at `/metrics`.

Every scrape reads the store (what `eagle3 status` reads, without sampling: the monitor keeps
it current), so the numbers are the ones Slack and the CLI show. A stage with no reading has
no sample for that metric — never a 0 that would read as "no progress".
"""

from __future__ import annotations

import logging
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from pipeline.config import Workspace
from pipeline.verdict import VERDICTS

log = logging.getLogger("eagle3.metrics")
HANDOFF_STEPS = ("off", "armed", "waiting-for-completion", "stopping-server", "waiting-for-gpu-release",
                 "launching-training", "training-running", "training-done", "training-failed", "failed")


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
        step = st.autostart or "off"
        for name in HANDOFF_STEPS if step in HANDOFF_STEPS else (*HANDOFF_STEPS, step):
            g["eagle3_handoff_step"].add_metric([name], 1.0 if name == step else 0.0)
        yield from g.values()
        yield from _counters(st, restarts)
        pending = GaugeMetricFamily("eagle3_slack_outbox_pending", "Slack messages waiting to be delivered.")
        pending.add_metric([], float(st.outbox.get("pending") or 0))
        yield pending
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
        for key in ("loss", "kl"):
            if isinstance(prog.get(key), (int, float)):
                m = GaugeMetricFamily(f"eagle3_train_{key}", f"The trainer's last logged {key}.")
                m.add_metric([], float(prog[key]))
                yield m
        train = st.stages["train"]
        if train.done is not None and (prog.get("unit") in (None, "steps")):
            m = GaugeMetricFamily("eagle3_train_step", "The trainer's last logged step.")
            m.add_metric([], float(train.done))
            yield m


def _counters(st, restarts: dict[str, int]):
    """Totals of the current run: samples done and failed, tokens, restarts (reset by a new run)."""
    from prometheus_client.core import CounterMetricFamily

    samples = CounterMetricFamily("eagle3_samples", "Samples processed by the stage in this run.",
                                  labels=["stage", "status"])
    tokens = CounterMetricFamily("eagle3_tokens", "Prompt tokens processed by the stage in this run.", labels=["stage"])
    restarted = CounterMetricFamily("eagle3_stage_restarts", "Restarts of the stage by its on-failure policy in "
                                    "this run.", labels=["stage"])
    for stage, s in st.stages.items():
        prog = s.progress or {}
        if prog.get("unit", "samples") == "samples" and s.done is not None:
            samples.add_metric([stage, "done"], float(s.done))
            samples.add_metric([stage, "failed"], float(s.failed or 0))
        if isinstance(prog.get("tokens_done"), (int, float)):
            tokens.add_metric([stage], float(prog["tokens_done"]))
        restarted.add_metric([stage], float(restarts.get(stage, 0)))
    yield from (samples, tokens, restarted)


def _build_info():
    from importlib.metadata import PackageNotFoundError, version

    from prometheus_client.core import GaugeMetricFamily

    try:
        ours = version("eagle3-ops")
    except PackageNotFoundError:
        ours = "unknown"
    import platform

    info = GaugeMetricFamily("eagle3_build_info", "Always 1; the version in labels.", labels=["version", "python"])
    info.add_metric([ours, platform.python_version()], 1.0)
    return info


class BuildInfo:
    def collect(self):
        yield _build_info()


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
    registry.register(BuildInfo())
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, …
    PlatformCollector(registry=registry)  # python_info
    server = make_server(host, port, make_wsgi_app(registry), server_class=_Threaded, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="eagle3-metrics", daemon=True).start()
    return server
