"""Slack's Socket Mode end, faked: a WebSocket server on 127.0.0.1 (plain socket, as slack_sdk uses for a
non-443 `ws://` URL) that says `hello`, hands out envelopes and records the app's acks.

Written against RFC 6455 by hand so a test controls what a real network does to a socket: `go_silent()`
stops answering pings on the open connections (a connection that died without a word: no FIN, no
close frame), as when a NAT or a load balancer drops it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import struct
import threading
import time

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.silent = False
        self.open = True
        self.lock = threading.Lock()

    def send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else
                                         (bytes([126]) + struct.pack("!H", n) if n < 65536 else
                                          bytes([127]) + struct.pack("!Q", n)))
        with self.lock:
            self.sock.sendall(head + payload)

    def read_frame(self) -> tuple[int, bytes]:
        b0, b1 = self._exact(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._exact(8))[0]
        mask = self._exact(4) if b1 & 0x80 else b"\0\0\0\0"
        data = self._exact(n)
        return b0 & 0x0F, bytes(c ^ mask[i % 4] for i, c in enumerate(data))

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out


class FakeSocketMode:
    """`url` goes in the fake Web API's `apps.connections.open` answer."""

    def __init__(self, *, num_connections: int = 1) -> None:
        self.num_connections = num_connections
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = f"ws://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.conns: list[_Conn] = []
        self.connected_at: list[float] = []  # monotonic time of each accepted connection
        self.acks: dict[str, tuple[float, dict]] = {}  # envelope_id -> (monotonic time, the app's answer)
        self.sent_at: dict[str, float] = {}
        self.closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = sock.recv(4096)
            if not chunk:
                return
            request += chunk
        key = next(line.split(":", 1)[1].strip() for line in request.decode("latin-1").split("\r\n")
                   if line.lower().startswith("sec-websocket-key:"))
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        sock.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
        conn = _Conn(sock)
        self.conns.append(conn)
        self.connected_at.append(time.monotonic())
        conn.send(0x1, json.dumps({"type": "hello", "num_connections": self.num_connections,
                                   "connection_info": {"app_id": "A0TEST"},
                                   "debug_info": {"host": "fake", "approximate_connection_time": 3600}}).encode())
        try:
            while not self.closing:
                opcode, data = conn.read_frame()
                if opcode == 0x9 and not conn.silent:  # ping → pong with the same payload
                    conn.send(0xA, data)
                elif opcode == 0x1:
                    msg = json.loads(data)
                    if msg.get("envelope_id"):
                        self.acks[msg["envelope_id"]] = (time.monotonic(), msg)
                elif opcode == 0x8:
                    conn.send(0x8, data[:2])
                    break
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            conn.open = False
            try:
                sock.close()
            except OSError:
                pass

    def live(self) -> list[_Conn]:
        return [c for c in self.conns if c.open and not c.silent]

    def send_slash(self, envelope_id: str, *, text: str, user: str = "UOK", channel: str = "C1",
                   response_url: str = "") -> None:
        """A `/eagle3 TEXT` slash command envelope on the newest live connection."""
        payload = {"token": "x", "team_id": "T1", "team_domain": "t", "channel_id": channel, "channel_name": "ops",
                   "user_id": user, "user_name": "u", "command": "/eagle3", "text": text, "api_app_id": "A0TEST",
                   "response_url": response_url, "trigger_id": "1.2.3"}
        self.sent_at[envelope_id] = time.monotonic()
        self.live()[-1].send(0x1, json.dumps({"envelope_id": envelope_id, "type": "slash_commands",
                                              "accepts_response_payload": True, "payload": payload}).encode())

    def send_event(self, envelope_id: str, event: dict) -> None:
        """An Events API envelope (e.g. app_home_opened) on the newest live connection."""
        payload = {"token": "x", "team_id": "T1", "api_app_id": "A0TEST", "type": "event_callback",
                   "event_id": f"Ev{envelope_id}", "event_time": int(time.time()), "event": event}
        self.sent_at[envelope_id] = time.monotonic()
        self.live()[-1].send(0x1, json.dumps({"envelope_id": envelope_id, "type": "events_api",
                                              "accepts_response_payload": False, "payload": payload}).encode())

    def go_silent(self) -> None:
        """The open connections stop answering pings (and stay open): dead without a word."""
        for c in self.conns:
            c.silent = True

    def close(self) -> None:
        self.closing = True
        self.listener.close()
        for c in self.conns:
            try:
                c.sock.close()
            except OSError:
                pass
