"""`eagle3 serve`: the monitor tick plus the transports, in one process."""

from __future__ import annotations

import os
import signal
import threading

from pipeline.config import Workspace
from pipeline.monitor import Monitor


def serve(ws: Workspace, *, max_ticks: int | None = None, http_port: int | None = None,
          host: str = "127.0.0.1") -> int:
    """Run until SIGTERM/SIGINT (or `max_ticks`); with `http_port`, also Slack's HTTP events."""
    from pipeline.store import Store

    Store(ws.store_path).close()  # an unusable store stops us here, with its one line, before any thread starts
    notifier = _notifier(ws)
    if notifier:
        transport = f"posting to {notifier.channel}"
    elif os.environ.get("SLACK_BOT_TOKEN"):
        transport = "console transport (SLACK_BOT_TOKEN is set but [slack] channel is not: posts stay here)"
    else:
        transport = "console transport (no Slack tokens)"
    notifier = notifier or console_notifier(ws)
    monitor = Monitor(ws=ws, on_tick=lambda store, _results: notifier.tick(store))
    scheduler = _schedule_status_posts(ws, notifier)
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
    server = serve_http(app, signing_secret=secret, host=host, port=port)
    return server, f"Slack HTTP events on http://{host}:{server.server_address[1]}/slack/events"


def console_notifier(ws: Workspace, out=None):
    """Messages printed as they would appear in Slack (the embedded default, and the demo)."""
    from bot.console import ConsoleClient
    from bot.notifier import Notifier
    from pipeline.store import CONSOLE_CHANNEL

    return Notifier(ws=ws, client=ConsoleClient(out), channel=CONSOLE_CHANNEL, key_prefix="console:", pace_s=0.0)


def _notifier(ws: Workspace):
    """A Slack notifier when SLACK_BOT_TOKEN and a channel are set; else None (console only)."""
    token = os.environ.get("SLACK_BOT_TOKEN")
    if not token:
        return None
    from bot.app import slack_client
    from bot.notifier import Notifier

    client = slack_client(token, os.environ.get("SLACK_API_URL"))
    notifier = Notifier(ws=ws, client=client)
    return notifier if notifier.channel else None


def _schedule_status_posts(ws: Workspace, notifier):
    """APScheduler 3.x: one status post per run, updated in place every post_interval_min (and at start)."""
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

    post()  # at start, before the first tick: the steps and milestones that follow are replies in its thread
    scheduler = BackgroundScheduler(job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60})
    scheduler.add_job(post, "interval", minutes=ws.config.slack.post_interval_min, id="status-post",
                      replace_existing=True)
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
