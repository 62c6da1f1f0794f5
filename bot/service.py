"""`eagle3 serve`: the monitor tick plus the transports, in one process."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from handlers.views import event_text
from pipeline.config import Workspace
from pipeline.monitor import Monitor


class ConsoleEvents:
    """Prints new events (verdicts, handoff steps, restarts, reminders) as they are recorded."""

    def __init__(self, out=sys.stdout, *, since_t: float | None = None) -> None:
        self.out = out
        self.since_t = time.time() if since_t is None else since_t
        self.after_id = 0

    def __call__(self, store, _results) -> None:
        for event in store.events(after_id=self.after_id):
            self.after_id = event["id"]
            line = event_text(event) if event["t"] >= self.since_t else None  # older history: `eagle3 status`
            if line:
                print(line, file=self.out, flush=True)


def serve(ws: Workspace, *, max_ticks: int | None = None, http_port: int | None = None,
          host: str = "127.0.0.1") -> int:
    """Run until SIGTERM/SIGINT (or `max_ticks`); with `http_port`, also Slack's HTTP events."""
    console, notifier = ConsoleEvents(), _notifier(ws)

    def on_tick(store, results) -> None:
        console(store, results)
        if notifier:
            notifier.tick(store)

    monitor = Monitor(ws=ws, on_tick=on_tick)
    transport = "console transport (no Slack tokens)" if not notifier else f"posting to {ws.config.slack.channel}"
    scheduler = _schedule_status_posts(ws, notifier) if notifier else None
    server = None
    socket_mode = None
    if http_port is not None:
        server, transport = _start_http(ws, host, http_port)
    elif os.environ.get("SLACK_APP_TOKEN"):
        socket_mode, transport = _start_socket_mode(ws)

    def stop(_signum, _frame):
        monitor.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    print(f"eagle3 serve: monitoring {ws.path} every {ws.config.monitor.tick_s:g} s; {transport}; "
          "Ctrl-C to stop", flush=True)
    try:
        monitor.run(max_ticks=max_ticks)
    finally:
        if server:
            server.shutdown()
        if scheduler:
            scheduler.shutdown(wait=False)
        if socket_mode:
            socket_mode.close()
    print("eagle3 serve: stopped (stages keep running)", flush=True)
    return 0


def _start_http(ws: Workspace, host: str, port: int):
    from bot.app import build_app, serve_http
    from pipeline.errors import UserError

    secret = os.environ.get("SLACK_SIGNING_SECRET")
    if not secret:
        raise UserError("serve --http: set SLACK_SIGNING_SECRET (from the Slack app's Basic Information page)")
    app = build_app(ws=ws, token=os.environ.get("SLACK_BOT_TOKEN", ""), signing_secret=secret,
                    api_url=os.environ.get("SLACK_API_URL"))
    server = serve_http(app, host=host, port=port)
    return server, f"Slack HTTP events on http://{host}:{server.server_address[1]}/slack/events"


def _notifier(ws: Workspace):
    """A Slack notifier when SLACK_BOT_TOKEN and a channel are set; else None (console only)."""
    token = os.environ.get("SLACK_BOT_TOKEN")
    if not token:
        return None
    from slack_sdk import WebClient
    from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

    from bot.app import DEFAULT_API_URL
    from bot.notifier import Notifier

    client = WebClient(token=token, base_url=(os.environ.get("SLACK_API_URL") or DEFAULT_API_URL).rstrip("/") + "/",
                       timeout=10)
    client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=3))
    notifier = Notifier(ws=ws, client=client)
    return notifier if notifier.channel else None


def _schedule_status_posts(ws: Workspace, notifier):
    """APScheduler 3.x: one status post per run, updated in place every post_interval_min (and at start)."""
    from datetime import datetime

    from apscheduler.schedulers.background import BackgroundScheduler

    from pipeline.controller import Controller

    def post() -> None:
        ctl = Controller(workspace=ws)
        try:
            status = ctl.status(sample_if_unmonitored=False)
            if status["run"]:
                notifier.post_status(ctl.store, status, ctl.state_version())
        finally:
            ctl.close()

    scheduler = BackgroundScheduler(job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60})
    scheduler.add_job(post, "interval", minutes=ws.config.slack.post_interval_min, id="status-post",
                      replace_existing=True, next_run_time=datetime.now())
    scheduler.start()
    return scheduler


def _start_socket_mode(ws: Workspace):
    """Socket Mode: no inbound port (SLACK_APP_TOKEN, xapp-…, with connections:write)."""
    from slack_bolt.adapter.socket_mode import SocketModeHandler

    from bot.app import build_app
    from pipeline.errors import UserError

    token = os.environ.get("SLACK_BOT_TOKEN")
    if not token:
        raise UserError("Socket Mode needs SLACK_BOT_TOKEN as well as SLACK_APP_TOKEN")
    app = build_app(ws=ws, token=token, signing_secret=os.environ.get("SLACK_SIGNING_SECRET", "unused-in-socket-mode"),
                    api_url=os.environ.get("SLACK_API_URL"))
    handler = SocketModeHandler(app, os.environ["SLACK_APP_TOKEN"])
    handler.connect()
    return handler, "Slack Socket Mode"
