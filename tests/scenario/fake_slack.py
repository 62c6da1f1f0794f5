"""A fake Slack Web API on 127.0.0.1 (port 0) recording every call, plus response_url webhooks."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl


class FakeSlack:
    """Records calls as (method, params); answers {"ok": true, …}."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.fail: dict[str, int] = {}  # method -> how many of its next calls answer 500
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                try:
                    params = json.loads(raw) if raw.startswith("{") else dict(parse_qsl(raw))
                except ValueError:
                    params = {"raw": raw}
                method = self.path.rsplit("/", 1)[-1] if self.path.startswith("/api/") else "response_url"
                if fake.fail.get(method, 0) > 0:  # an injected outage: nothing is recorded as delivered
                    fake.fail[method] -= 1
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                fake.calls.append((method, params))
                ts = f"1790000000.{len(fake.calls):06d}"
                body = json.dumps({"ok": True, "channel": params.get("channel"), "ts": ts}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def of(self, method: str) -> list[dict]:
        return [p for m, p in self.calls if m == method]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
