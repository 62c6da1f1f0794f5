"""A fake Slack Web API on 127.0.0.1 (port 0) recording every call, plus response_url webhooks.

Faults are scripted per method: `fail[method] = n` answers the next n calls with 500;
`script[method]` is a list of answers used up one per call: ("429", retry_after_s),
`delay_s` makes every answer slow,
file uploads follow files_upload_v2's flow: files.getUploadURLExternal answers an upload_url on
this server, the bytes POSTed there are recorded as method "upload" ({"file_id", "bytes", "png"}),
files.completeUploadExternal answers the files it completed,
("500", None) or ("error", "channel_not_found") for an HTTP 200 `{"ok": false}`.
A faulted call is not recorded as delivered; its time goes to `faults`.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl


class FakeSlack:
    """Records calls as (method, params); answers {"ok": true, …} unless a fault is scripted."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.times: list[float] = []  # monotonic time of each recorded call
        self.faults: list[tuple[str, str, float]] = []  # (method, fault, monotonic time)
        self.fail: dict[str, int] = {}
        self.script: dict[str, list[tuple[str, object]]] = {}
        self.delay_s = 0.0  # every answer waits this long first (a slow Slack)
        self.answers: dict[str, dict] = {}  # extra fields of a method's answer (apps.connections.open: url)
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict | None, headers: dict | None = None) -> None:
                raw = json.dumps(body).encode() if body is not None else b""
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/upload/"):
                    method, params = "upload", {"file_id": self.path.rsplit("/", 1)[-1], "bytes": len(body),
                                                "png": body[:8] == b"\x89PNG\r\n\x1a\n"}
                else:
                    raw = body.decode()
                    try:
                        params = json.loads(raw) if raw.startswith("{") else dict(parse_qsl(raw))
                    except ValueError:
                        params = {"raw": raw}
                    method = self.path.rsplit("/", 1)[-1] if self.path.startswith("/api/") else "response_url"
                time.sleep(fake.delay_s)
                with fake.lock:
                    fault = fake._next_fault(method)
                    if fault is None:
                        fake.calls.append((method, params))
                        fake.times.append(time.monotonic())
                        ts = f"1790000000.{len(fake.calls):06d}"
                    else:
                        fake.faults.append((method, fault[0], time.monotonic()))
                if fault is None:
                    return self._answer(200, {"ok": True, "channel": params.get("channel"), "ts": ts,
                                              **fake._files(method, params), **fake.answers.get(method, {})})
                kind, arg = fault
                if kind == "429":
                    return self._answer(429, {"ok": False, "error": "ratelimited"}, {"Retry-After": str(arg)})
                if kind == "error":
                    return self._answer(200, {"ok": False, "error": arg})
                return self._answer(500, None)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _files(self, method: str, params: dict) -> dict:
        """The extra fields of the file-upload methods' answers."""
        if method == "files.getUploadURLExternal":
            file_id = f"F{len(self.calls):06d}"
            return {"file_id": file_id, "upload_url": f"{self.url}/upload/{file_id}"}
        if method == "files.completeUploadExternal":
            return {"files": [{"id": f["id"], "title": f.get("title")} for f in json.loads(params.get("files", "[]"))]}
        return {}

    def _next_fault(self, method: str):
        if self.script.get(method):
            return self.script[method].pop(0)
        if self.fail.get(method, 0) > 0:
            self.fail[method] -= 1
            return ("500", None)
        return None

    def of(self, method: str) -> list[dict]:
        return [p for m, p in self.calls if m == method]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
