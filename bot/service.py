"""`eagle3 serve`: the monitor tick, Slack delivery and the transports, in one process.

The monitor (observations, verdicts, the handoff) never waits for Slack: delivery runs
in its own thread, and a transport that cannot connect retries with backoff in the
background, saying so in `eagle3 status`, while monitoring and the handoff go on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

from bot.metrics import serve_metrics
from pipeline.config import LiveWorkspace, Workspace
from pipeline.configcheck import placeholders, problems
from pipeline.controller import Controller
from pipeline.errors import ConfigError, UserError
from pipeline.monitor import Monitor
from pipeline.servelock import ServeLock
from pipeline.store import CONSOLE_CHANNEL, KV, Store, thread_store

if TYPE_CHECKING:  # types only: Bolt's Socket Mode and wsgiref load when serve uses them
    from wsgiref.simple_server import WSGIServer

    from slack_bolt.adapter.socket_mode import SocketModeHandler

log = logging.getLogger("eagle3.service")
DELIVERY_INTERVAL_S = 1.0
DRAIN_S = 5.0  # at shutdown: how long to keep delivering what is due
AUTH_RETRY_PASSES = 30  # an unreachable Slack: auth.test again after this many delivery passes
RECONNECT_MAX_S = 60.0
# slack_sdk calls a socket stale after more than 4 ping intervals without a pong (whole seconds),
# checked every interval: 1.5 s replaces a connection that died without a word within about 9.5 s
# plus the new handshake (at 2 s: 11 s, 15.2 s measured once on a loaded host; Bolt's 10 s: ~55 s).
PING_INTERVAL_S = 1.5
CONNECTED_CHECK_S = 1.0  # is_connected() reads a flag: our loop reconnects a second after a socket closes
REFRESH_GRACE_S = 5.0


def serve(ws: Workspace, *, max_ticks: int | None = None, http_port: int | None = None,
          host: str = "127.0.0.1", metrics_port: int | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `max_ticks`); with `http_port`, also Slack's HTTP events; with a
    metrics port (the flag, or `[metrics] port`), Prometheus' /metrics."""
    Store(ws.store_path).close()  # an unusable store stops us here, with its one line, before any thread starts
    _refuse_placeholders(ws)
    with ServeLock(ws.state_dir / "serve.lock"):
        return _serve(ws, max_ticks=max_ticks, http_port=http_port, host=host,
                      metrics_port=metrics_port if metrics_port is not None else ws.config.metrics.port)


def _refuse_placeholders(ws: Workspace) -> None:
    """A template with <PLACEHOLDERS> left would fail hours later, at the first start: refuse now.
    The other problems `check-config` finds are printed as warnings."""
    left = placeholders(ws)
    if left:
        raise ConfigError(f"{left[0]} ({len(left)} placeholder(s) left; `eagle3 check-config` lists them); "
                          "serve refuses a config that is not filled in")
    for line in problems(ws, path_env=os.environ.get("PATH", "")):
        print(f"eagle3 serve: warning: {line}", flush=True)


def _serve(ws: Workspace, *, max_ticks: int | None, http_port: int | None, host: str,
           metrics_port: int | None = None) -> int:
    notifier, posting = _notifier(ws)
    live = LiveWorkspace(ws)  # the config file as it is now: the monitor and the Slack commands read it, as the CLI
    monitor = Monitor(ws=ws, live=live)
    delivery = Delivery(ws=ws, notifier=notifier)
    inputs = Inputs(ws=ws, live=live)  # first: a refusal (no signing secret) leaves no thread behind
    if http_port is not None:
        inputs.start_http(host, http_port)
    elif os.environ.get("SLACK_APP_TOKEN"):
        inputs.start_socket_mode()
    metrics = None
    if metrics_port is not None:
        try:
            metrics = serve_metrics(ws, host=ws.config.metrics.host, port=metrics_port)
        except OSError as exc:
            inputs.close()
            raise UserError(f"metrics: cannot listen on {ws.config.metrics.host}:{metrics_port} ({exc.strerror}); "
                            "choose another --metrics-port") from None
    scheduler = _schedule_status_posts(ws, delivery)

    def stop(_signum, _frame):
        monitor.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    print(f"eagle3 serve: monitoring {ws.path} every {ws.config.monitor.tick_s:g} s; {posting}; "
          f"commands and buttons: {inputs.describe()}; Ctrl-C to stop", flush=True)
    if metrics:
        print(f"eagle3 serve: Prometheus metrics on http://{ws.config.metrics.host}:{metrics.server_address[1]}"
              "/metrics", flush=True)
    delivery.start()
    try:
        monitor.run(max_ticks=max_ticks)
    finally:
        inputs.close()
        if metrics:
            metrics.shutdown()
        if scheduler:
            scheduler.shutdown(wait=False)
        delivery.close()
    print("eagle3 serve: stopped (stages keep running)", flush=True)
    return 0


class Delivery:
    """The notifier in its own thread and store connection: a Slack that is slow, rate-limiting
    or down delays no observation, verdict or handoff step. Each pass also posts the run's
    status message as soon as a run opens, so its steps and milestones thread under it."""

    def __init__(self, *, ws: Workspace, notifier) -> None:
        self.ws = ws
        self.notifier = notifier
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # one pass at a time (the thread, the scheduler's post, the last flush)
        self.thread = threading.Thread(target=self._loop, name="eagle3-delivery", daemon=True)
        self.auth_checked = not hasattr(notifier.client, "auth_test")  # the console has no token to check

    def start(self) -> None:
        """Start delivering."""
        self.thread.start()

    def post_status(self) -> None:
        """Enqueue (or refresh) the open run's status message."""
        with self.lock:
            ctl = Controller(workspace=self.ws, store=thread_store(self.ws.store_path))
            try:
                status = ctl.status(sample_if_unmonitored=False)
                if status.run:
                    self.notifier.post_status(ctl.store, status, ctl.state_version())
            finally:
                ctl.close()

    def one_pass(self) -> None:
        """A new run's status post if it has none yet, then collect and deliver."""
        store = thread_store(self.ws.store_path)
        if self.notifier.needs_status(store):
            self.post_status()
        final = self.notifier.final_due(store)
        if final:
            with self.lock:
                ctl = Controller(workspace=self.ws, store=store)
                self.notifier.post_final(store, ctl.status(sample_if_unmonitored=False), *final)
        with self.lock:
            self.notifier.tick(store)

    def check_auth(self) -> None:
        """`auth.test` once: a refused token is one line in the log and in `eagle3 status`, at start
        rather than at the first post. An unreachable Slack is tried again on a later pass."""
        from slack_sdk.errors import SlackApiError


        try:
            r = self.notifier.client.auth_test()
            result = {"ok": True, "user": r.get("user"), "team": r.get("team")}
            log.info("slack: the bot token works (@%s in %s)", result["user"], result["team"])
        except SlackApiError as exc:
            error = (exc.response.get("error") if isinstance(exc.response.data, dict) else None) or (
                f"HTTP {exc.response.status_code}")
            if exc.response.status_code >= 500 or error in ("ratelimited", "internal_error", "service_unavailable"):
                return
            result = {"ok": False, "error": error}
            log.error("slack: Slack refused the bot token (%s): check SLACK_BOT_TOKEN in the env file, then restart",
                      error)
        except OSError:
            return
        thread_store(self.ws.store_path).put(KV.SLACK_AUTH, result)
        self.auth_checked = True

    def _loop(self) -> None:
        passes = 0
        while not self.stopping.wait(DELIVERY_INTERVAL_S):
            if not self.auth_checked and passes % AUTH_RETRY_PASSES == 0:
                self.check_auth()
            passes += 1
            try:
                self.one_pass()
            except Exception:  # noqa: BLE001 - delivery retries next pass; the monitor is unaffected
                log.exception("slack delivery pass failed; retrying")

    def close(self) -> None:
        """Stop the thread, then drain: what the last ticks made is delivered (paced, for up to
        DRAIN_S) unless Slack is failing; whatever is left stays in the outbox for the next start."""

        self.stopping.set()
        self.thread.join(timeout=30)
        deadline = time.monotonic() + DRAIN_S
        while True:
            try:
                self.one_pass()
            except Exception:  # noqa: BLE001
                log.exception("last slack delivery pass failed; the messages stay in the outbox")
                return
            due = [m for m in thread_store(self.ws.store_path).pending_messages(channel=self.notifier.channel)
                   if m["next_try"] <= time.time()]
            if not due or time.monotonic() >= deadline:
                return
            time.sleep(0.2)


class Inputs:
    """Where commands and buttons come from: Socket Mode, Slack's HTTP events, or nowhere.
    Socket Mode connects in the background with backoff; its state is in the store for `status`."""

    def __init__(self, *, ws: Workspace, live: LiveWorkspace | None = None) -> None:
        self.ws, self.live = ws, live
        self.kind = "none"
        self.host = "127.0.0.1"
        self.server: WSGIServer | None = None  # serve --http's server, once started
        self.handler: SocketModeHandler | None = None  # Socket Mode's handler, once started
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def describe(self) -> str:
        """The start line's account of what is served."""
        if self.kind == "http":
            port = self.server.server_address[1] if self.server is not None else "?"
            return f"Slack HTTP events on http://{self.host}:{port}/slack/events"
        if self.kind == "socket-mode":
            return "Slack Socket Mode (connecting in the background; `eagle3 status` shows its state)"
        return ("not served (set SLACK_APP_TOKEN for Socket Mode, or run `eagle3 serve --http --port P` with "
                "SLACK_SIGNING_SECRET for Slack's HTTP events)")

    def start_http(self, host: str, port: int) -> None:
        """Serve Slack's HTTP events (a listening socket: no connection to Slack needed to start)."""
        from bot.app import build_app, serve_http

        secret = os.environ.get("SLACK_SIGNING_SECRET")
        if not secret:
            raise UserError("serve --http: set SLACK_SIGNING_SECRET (from the Slack app's Basic Information page)")
        app = build_app(ws=self.ws, token=os.environ.get("SLACK_BOT_TOKEN", ""), signing_secret=secret,
                        api_url=os.environ.get("SLACK_API_URL"), live=self.live)
        self.server = serve_http(app, signing_secret=secret, host=host, port=port)
        self.host = host
        self.kind = "http"
        self._record("listening", None)

    def start_socket_mode(self) -> None:
        """Socket Mode: no inbound port (SLACK_APP_TOKEN, xapp-…, with connections:write)."""
        from slack_bolt.adapter.socket_mode import SocketModeHandler

        from bot.app import build_app

        token = os.environ.get("SLACK_BOT_TOKEN")
        if not token:
            raise UserError("Socket Mode needs SLACK_BOT_TOKEN as well as SLACK_APP_TOKEN")
        app = build_app(ws=self.ws, token=token,
                        signing_secret=os.environ.get("SLACK_SIGNING_SECRET", "unused-in-socket-mode"),
                        api_url=os.environ.get("SLACK_API_URL"), live=self.live)
        self.handler = handler = SocketModeHandler(app, os.environ["SLACK_APP_TOKEN"], ping_interval=PING_INTERVAL_S)
        handler.client.on_message_listeners.append(self._on_message)
        handler.client.on_close_listeners.append(self._on_close)
        self._warned_connections = False
        self._refresh_at = float("-inf")
        self._session = None
        self.kind = "socket-mode"
        self._record("connecting", None)
        self.thread = threading.Thread(target=self._keep_connected, name="eagle3-socket-mode", daemon=True)
        self.thread.start()

    def _keep_connected(self) -> None:
        delay, connected, failing = 1.0, False, False
        while not self.stopping.is_set():
            try:
                if not self._socket.client.is_connected():
                    if not failing:  # while retrying, the state stays "retrying" with the last error
                        self._record("reconnecting" if connected else "connecting", None)
                    self._socket.connect()
                    log.info("slack: Socket Mode connected")
                connected, delay, failing = True, 1.0, False
                self._record("connected", None)
                wait = CONNECTED_CHECK_S
            except Exception as exc:  # noqa: BLE001 - unreachable Slack: retry; the monitor keeps running
                error = f"{type(exc).__name__}: {exc}"
                log.warning("slack: Socket Mode cannot connect (%s); retrying in %.0f s", error, delay)
                self._record("retrying", error, retry_in_s=delay)
                wait, delay, failing = delay, min(RECONNECT_MAX_S, delay * 2), True
            self.stopping.wait(wait)

    def _on_message(self, message: str) -> None:
        """Slack's `hello` says how many sockets the app has open: above 1, another host shares this app."""
        if '"hello"' not in message and '"disconnect"' not in message:
            return
        try:
            msg = json.loads(message)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if msg.get("type") == "disconnect":  # Slack asked for a refresh: slack_sdk opens the new socket
            self._refresh_at = time.monotonic()  # before it closes the old one, so the next hello says 2
            return
        if msg.get("type") == "hello":
            self._note_session()
        n = msg.get("num_connections") if msg.get("type") == "hello" else None
        if not isinstance(n, int) or n <= 1 or self._warned_connections:
            return
        if time.monotonic() - self._refresh_at < REFRESH_GRACE_S:
            return
        self._warn_connections(n)

    def _note_session(self) -> None:
        """Each hello after the first is a reconnect: log it with its cause."""
        current = getattr(self._socket.client, "current_session", None)
        old, self._session = self._session, current
        if old is None or old is current:
            return
        last = getattr(old, "last_ping_pong_time", None) or getattr(old, "_first_ping_time", None)
        silent_s = time.time() - last if last else 0.0
        if time.monotonic() - self._refresh_at < REFRESH_GRACE_S:
            cause = "Slack asked for a refresh"
        elif silent_s > 2 * PING_INTERVAL_S:
            cause = f"the previous socket answered no ping for {silent_s:.0f} s"
        else:
            cause = "the previous socket closed"
        log.info("slack: Socket Mode reconnected (%s)", cause)

    def _warn_connections(self, n: int) -> None:
        self._warned_connections = True
        host = socket.gethostname()
        reason = (f"{n} Socket Mode connections share this Slack app (this host: {host}, pid {os.getpid()}): "
                  "Slack spreads commands over them at random, so another eagle3 serve may answer for this one. "
                  "Give each host (or controller) its own Slack app")
        log.warning("slack: %s", reason)
        store = thread_store(self.ws.store_path)
        store.add_event(kind="transport-warning", run_id=store.current_run(), data={"reason": reason})

    def _on_close(self, code: int, reason: str | None = None) -> None:
        if not self.stopping.is_set():
            log.info("slack: Socket Mode connection closed (code %s%s); reconnecting", code,
                     f", {reason}" if reason else "")

    def _record(self, state: str, error: str | None, **extra) -> None:
        store = thread_store(self.ws.store_path)
        old = store.get(KV.TRANSPORT) or {}
        since = old.get("since") if old.get("state") == state else time.time()
        store.put(KV.TRANSPORT, {"kind": self.kind, "state": state, "error": error, "since": since,
                                "pid": os.getpid(), **extra})

    CLOSE_WAIT_S = 10.0

    @property
    def _socket(self) -> SocketModeHandler:
        """Socket Mode's handler: its methods run only once `start_socket_mode` made it."""
        if self.handler is None:
            raise RuntimeError("Socket Mode was not started")
        return self.handler

    def _close_handler(self) -> None:
        try:
            self._socket.close()
        except Exception:  # noqa: BLE001 - closing a connection that never opened
            pass

    def close(self) -> None:
        """Stop serving; say so in the store."""
        self.stopping.set()
        if self.server:
            self.server.shutdown()
        if self.handler:
            # slack_sdk's close joins its session monitor, which can sit in a reconnect to an endpoint that died
            # without a word for as long as that takes (seen in the suite: over 90 s): the service stops anyway
            closer = threading.Thread(target=self._close_handler, name="socket-mode-close", daemon=True)
            closer.start()
            closer.join(timeout=self.CLOSE_WAIT_S)
            if closer.is_alive():
                log.warning("the Socket Mode client did not close within %.0f s (a reconnect in progress); it ends "
                            "with the process", self.CLOSE_WAIT_S)
        if self.thread:
            self.thread.join(timeout=10)
        if self.kind != "none":
            self._record("stopped", None)


def console_notifier(ws: Workspace, out=None):
    """Messages printed as they would appear in Slack (the embedded default, and the demo)."""
    from bot.console import ConsoleClient
    from bot.notifier import Notifier

    return Notifier(ws=ws, client=ConsoleClient(out), channel=CONSOLE_CHANNEL, key_prefix="console:", pace_s=0.0)


def _notifier(ws: Workspace):
    """(notifier, what it posts to): Slack when SLACK_BOT_TOKEN and a channel are set, else the console."""
    token = os.environ.get("SLACK_BOT_TOKEN")
    if token:
        from bot.app import slack_client
        from bot.notifier import Notifier

        notifier = Notifier(ws=ws, client=slack_client(token, os.environ.get("SLACK_API_URL")))
        if notifier.channel:
            return notifier, f"posting to {notifier.channel}"
        return console_notifier(ws), "console transport (SLACK_BOT_TOKEN is set but [slack] channel is not: posts stay here)"
    return console_notifier(ws), "console transport (no Slack tokens)"


def _schedule_status_posts(ws: Workspace, delivery: Delivery):
    """APScheduler 3.x: the run's status post refreshed in place every post_interval_min (and at start)."""
    from apscheduler.schedulers.background import BackgroundScheduler

    delivery.post_status()  # at start, before the first tick: the steps and milestones that follow thread under it
    scheduler = BackgroundScheduler(job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60})
    scheduler.add_job(delivery.post_status, "interval", minutes=ws.config.slack.post_interval_min, id="status-post",
                      replace_existing=True)
    scheduler.start()
    return scheduler
