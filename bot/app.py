"""The Bolt app factory (sync `App`, no module-level app) and the HTTP transport."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from socketserver import ThreadingMixIn
from urllib.parse import parse_qsl
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from slack_bolt import App
from slack_bolt.adapter.wsgi import SlackRequestHandler
from slack_sdk import WebClient
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler
from slack_sdk.signature import SignatureVerifier

from handlers import buttons, home, slash
from handlers.auth import guard
from pipeline.config import LiveWorkspace, Workspace
from pipeline.controller import Controller
from pipeline.store import thread_store

log = logging.getLogger("eagle3.bot")
DEFAULT_API_URL = "https://slack.com/api/"
SIGNATURE_MAX_AGE_S = 300  # Slack's own rule, as slack_sdk's SignatureVerifier applies it
READ_TIMEOUT_S = 10.0  # per connection: Slack sends its whole request at once
MAX_BODY_BYTES = 1 << 20  # Slack's payloads are a few kB; anything far larger is not Slack


def slack_client(token: str, api_url: str | None = None) -> WebClient:
    """A Web API client (SLACK_API_URL may point it elsewhere) that waits out a 429's Retry-After."""
    client = WebClient(token=token, base_url=(api_url or DEFAULT_API_URL).rstrip("/") + "/", timeout=10)
    client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=3))
    return client


class _DropClientTokenWarning(logging.Filter):
    """Bolt warns on every start that the token is unused when a client is given and
    SLACK_BOT_TOKEN is set: both are ours and the same token, so the warning says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "token` will be unused" not in record.getMessage()


_DROP_TOKEN_WARNING = _DropClientTokenWarning()


def build_app(*, ws: Workspace, token: str, signing_secret: str, api_url: str | None = None,
              live: LiveWorkspace | None = None) -> App:
    """A Bolt app whose listeners call controller verbs; with `live`, each request's controller has the config as
    the monitor last loaded it (an edit that loads is used as the CLI uses it; no request reads the file)."""
    logging.getLogger("slack_bolt.App").addFilter(_DROP_TOKEN_WARNING)  # the same object: added once
    # process_before_response=False: Bolt answers Slack as soon as a listener calls ack() and runs
    # the rest in its bounded listener pool, so a slow or rate-limiting Web API (chat.update,
    # response_url, a 429's Retry-After) never delays an ack past Slack's 3 s.
    app = App(client=slack_client(token, api_url), signing_secret=signing_secret, token_verification_enabled=False,
              process_before_response=False)

    def controller_factory() -> Controller:
        # Listeners run in Bolt's bounded pool: each of its threads keeps one sqlite connection (`thread_store`),
        # so a request opens nothing.
        return Controller(workspace=live.ws if live is not None else ws,  # what the monitor loaded
                          store=thread_store(ws.store_path))

    _warm_authorization(app)
    # authorization and audit, in front of every listener; a refused click is answered from Bolt's own pool
    app.middleware(guard(ws, controller_factory, app.listener_runner.listener_executor))
    slash.register(app, controller_factory=controller_factory, ws=ws)
    buttons.register(app, controller_factory=controller_factory, ws=ws)
    home.register(app, controller_factory=controller_factory)

    @app.error
    def on_error(error, body, logger):  # a listener bug: logged (no tokens), never shown as a traceback
        logger.error("listener failed: %s: %s", type(error).__name__, error)

    return app


def _warm_authorization(app: App) -> None:
    """Bolt's single-workspace authorization calls `auth.test` on the first request and caches it: with
    a slow Slack that call sits in front of the first ack (measured: 4 s in Socket Mode). Make it now,
    in the background, so requests find it cached."""
    from slack_bolt.middleware.authorization.single_team_authorization import (
        SingleTeamAuthorization,
    )

    auth = next((m for m in app._middleware_list if isinstance(m, SingleTeamAuthorization)), None)  # noqa: SLF001
    if auth is None or auth.auth_test_result:
        return

    def warm() -> None:
        try:
            auth.auth_test_result = auth.auth_test_result or app.client.auth_test()
        except Exception as exc:  # noqa: BLE001 - the first request will try again; serve reports auth itself
            logging.getLogger("eagle3.app").info("slack: auth.test at start failed (%s); the first request retries",
                                                 type(exc).__name__)

    threading.Thread(target=warm, name="eagle3-auth-warm", daemon=True).start()


_OBJECTS = ("user", "channel", "team", "container", "message", "view", "state", "enterprise")


def _malformed(body: bytes) -> str | None:
    """Why a Slack request body cannot be handled, or None. Bolt itself raises on these
    (invalid JSON, or a `payload` whose fields have the wrong shape)."""
    try:
        text = body.decode("utf-8")
        if text.startswith("{"):
            data = json.loads(text)
        elif "payload=" in text:
            data = json.loads(dict(parse_qsl(text, keep_blank_values=True)).get("payload", ""))
        else:
            return None
    except (UnicodeDecodeError, ValueError) as exc:
        return f"malformed request body ({type(exc).__name__})"
    if not isinstance(data, dict):
        return "payload is not a JSON object"
    for key in _OBJECTS:
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"payload.{key} must be an object"
    actions = data.get("actions")
    if actions is not None and not (isinstance(actions, list) and all(isinstance(a, dict) for a in actions)):
        return "payload.actions must be a list of objects"
    if data.get("type") == "block_actions" and not (
            actions and all(isinstance(a.get("action_id"), str) for a in actions)):
        return "payload.actions must name an action_id each"  # Bolt indexes actions[0]["action_id"]
    return None


class GuardedHandler:
    """WSGI wrapper: the request signature first (401), then a malformed body gets 400 —
    Bolt's own parser would raise on it and drop the connection. Nothing unsigned is parsed."""

    def __init__(self, app: App, signing_secret: str) -> None:
        self.inner = SlackRequestHandler(app)
        self.verifier = SignatureVerifier(signing_secret)

    def _unsigned(self, body: bytes, environ) -> str | None:
        """Why the request is not validly signed, or None. A stale timestamp is told apart from
        a wrong signature: clock skew must not look like a wrong signing secret in the log."""
        ts, sig = environ.get("HTTP_X_SLACK_REQUEST_TIMESTAMP", ""), environ.get("HTTP_X_SLACK_SIGNATURE", "")
        if not (ts and sig):
            return "missing signature headers"
        try:
            skew = abs(time.time() - int(ts))
        except ValueError:
            return "timestamp is not a number"
        if skew > SIGNATURE_MAX_AGE_S:
            return (f"timestamp {skew:.0f} s away from this host's clock (over {SIGNATURE_MAX_AGE_S} s): a replay, "
                    "or this host's clock is wrong (check `timedatectl`)")
        if not self.verifier.is_valid(body=body, timestamp=ts, signature=sig):
            return "signature does not match: SLACK_SIGNING_SECRET differs from the app's Signing Secret"
        return None

    def __call__(self, environ, start_response):
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > MAX_BODY_BYTES:
            start_response("413 Payload Too Large", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"request body too large"]
        try:
            body = environ["wsgi.input"].read(length) if length > 0 else b""
        except OSError:  # the client stopped sending (read timeout) or went away
            start_response("408 Request Timeout", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"request body not received in time"]
        environ["wsgi.input"] = io.BytesIO(body)
        if environ.get("REQUEST_METHOD") == "POST":
            why = self._unsigned(body, environ)
            if why:
                log.warning("slack request refused (401): %s", why)
                start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"invalid request signature"]
            why = _malformed(body)
            if why:
                start_response("400 Bad Request", [("Content-Type", "text/plain; charset=utf-8")])
                return [why.encode()]
        try:
            return self.inner(environ, start_response)
        except Exception as exc:  # noqa: BLE001 - Bolt's parser on a shape we did not foresee: 400, never a drop
            log.warning("slack request not handled: %s", type(exc).__name__)
            start_response("400 Bad Request", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"malformed request"]


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # a client that sends half a request is dropped, not waited for

    def log_message(self, fmt, *args):
        log.info("http: " + fmt, *args)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per connection: a slow or stuck client never holds the others' requests."""

    daemon_threads = True


def serve_http(app: App, *, signing_secret: str, host: str = "127.0.0.1", port: int = 3000):
    """Serve Slack's HTTP events at /slack/events in a thread; returns the server (port 0: any)."""
    server = make_server(host, port, GuardedHandler(app, signing_secret), server_class=_ThreadingWSGIServer,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="slack-http", daemon=True).start()
    return server
