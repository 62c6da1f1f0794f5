"""The extraction client's own state, a probe the client serves itself: the requests in flight and their age, the
samples waiting, the parse workers, the last sample written, and when the client's event loop last ran.

The client answers on an abstract Unix socket named after its pid (no file anywhere: nothing in the output tree
moves, and the process writes nothing unless asked). The answer comes from a daemon thread, so a client whose event
loop is blocked still answers, and says how long ago the loop last ran. `ask(pid)` is the reader's side; it never
raises.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

ASK_TIMEOUT_S = 2.0


def address(pid: int) -> str:
    return f"\0eagle3-extract-{pid}"


class StateServer:
    """Answers each connection with `snapshot()` as one JSON document, from a daemon thread."""

    def __init__(self, pid: int, snapshot: Callable[[], dict]) -> None:
        self.snapshot = snapshot
        self.thread: threading.Thread | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(address(pid))
            self.sock.listen(4)
        except OSError:  # another process of this pid's name (a reused pid's leftover): the state is not told
            self.sock.close()
            return
        self.thread = threading.Thread(target=self._serve, name="extract-state", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    body = json.dumps(self.snapshot()).encode()
                except Exception as exc:  # noqa: BLE001 - a state that cannot be told says why, never ends the client
                    body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                try:
                    conn.settimeout(ASK_TIMEOUT_S)
                    conn.sendall(body)
                except OSError:
                    pass

    def close(self) -> None:
        try:  # wakes the thread out of accept(): a close alone leaves the name bound while it waits there
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.thread is not None:  # the name is free once accept() has returned: a next run may bind it
            self.thread.join(timeout=2.0)


def ask(pid: int, *, timeout_s: float = ASK_TIMEOUT_S) -> dict | None:
    """The state of the extraction client `pid`; None where that process is not one (or did not answer)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(address(pid))
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        data = json.loads(b"".join(chunks))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
