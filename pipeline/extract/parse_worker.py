"""Parse workers: the extraction's requests, parsing, checking and writing in processes of their own.

The client's request loop holds the GIL while it reads answers; at the target's width (H = 7,168,
3 aux layers: 216 MB of JSON for 512 tokens) receiving an answer costs ~0.014 s and parsing and
writing it ~0.04–0.05 s of CPU per million floats (bench/RESULTS.md, the client's profile), so one
process caps a run at ~15–18 million floats a second. With `--parse-workers N` the client keeps the run's bookkeeping (which sample goes when,
the memory budget, retries, the manifest) and hands each admitted sample to one of N worker
processes (`python -m pipeline.extract.parse_worker`), which sends the request to the server
itself, then runs `storing.store_answer` on the answer — the function the client's threads run —
and replies with one line. No answer's bytes pass through the client: N workers use N cores.

The wire, both ways: a 4-byte big-endian length and that many bytes of JSON. The first message to
a worker is its setup (the run's StoreSpec, the server, the timeout, how many requests it may
have in flight); each request carries an id its reply repeats. A worker ignores SIGINT and
SIGTERM (the client decides what is finished on a stop, and drains), dies with the client
(PR_SET_PDEATHSIG), and exits at once when its input closes: a file it was writing is then
either absent (a temp file, removed on resume) or complete but not in the manifest (extracted
again on resume).
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from pipeline.extract.response import BadResponse

_LEN = struct.Struct(">I")


def _read_exact(fd: int, buf: memoryview) -> bool:
    """Fill buf from fd; False on end of input before it is full."""
    got = 0
    while got < len(buf):
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            return False
        got += n
    return True


def _read_json(fd: int):
    head = bytearray(_LEN.size)
    if not _read_exact(fd, memoryview(head)):
        return None
    body = bytearray(_LEN.unpack(head)[0])
    if not _read_exact(fd, memoryview(body)):
        return None
    return json.loads(body)


def _write_json(fd: int, obj) -> None:
    raw = json.dumps(obj).encode()
    _write_all(fd, _LEN.pack(len(raw)) + raw)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed pipe still ends the worker
        pass
    if os.getppid() != parent:  # the client died before the prctl
        os._exit(1)


class Http:
    """One thread's keep-alive connection to the server, reading each answer straight into a bytearray of its
    Content-Length (`readinto`: one copy from the socket, no chunk list, no parser between): about half httpx's
    streaming CPU for a 216 MB answer (bench/RESULTS.md, the extraction client's profile)."""

    def __init__(self, server: str, timeout_s: float) -> None:
        u = urlsplit(server)
        self.https, self.host, self.port = u.scheme == "https", u.hostname or "127.0.0.1", u.port
        self.prefix, self.timeout_s = u.path.rstrip("/"), timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def post(self, path: str, body: dict) -> tuple[int, bytearray]:
        """(status, the answer's bytes); a connection the server closed while idle is opened again once."""
        raw = json.dumps(body, separators=(",", ":")).encode()
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = self._connect()
            try:
                self.conn.request("POST", self.prefix + path, body=raw, headers={"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                data = _read_body(resp)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if reused and attempt == 0:
                    continue  # a keep-alive connection the server had closed: once more on a new one
                raise
            except BaseException:
                self.close()
                raise
            if resp.will_close:
                self.close()
            return resp.status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _read_body(resp: http.client.HTTPResponse) -> bytearray:
    length = resp.getheader("Content-Length")
    if length is None or not length.isdigit():  # chunked, or read to the close
        return bytearray(resp.read())
    buf = bytearray(int(length))
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = resp.readinto(view[got:])
        if not n:
            raise http.client.IncompleteRead(bytes(view[:got]), len(buf) - got)
        got += n
    return buf


def _request(body: dict, client: Http) -> bytearray | dict:
    """POST /generate; the answer's bytes, or the reply that tells the client why there are none."""
    try:
        status, content = client.post("/generate", body)
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut short
        return {"transport": f"{type(exc).__name__}: {exc}"}
    if status >= 400:
        return {"http": f"server answered HTTP {status}: {content[:200].decode(errors='replace')}"}
    return content


def _one(spec, req: dict, local, setup: dict, send) -> None:
    from pipeline.extract.storing import DiskError, store_answer

    if not hasattr(local, "client"):
        local.client = Http(setup["server"], setup["timeout_s"])
    try:
        t0 = time.monotonic()
        got = _request(req["body"], local.client)
        latency_s = time.monotonic() - t0
        if isinstance(got, dict):
            reply = got
        else:
            box = [got]
            del got
            s = store_answer(spec, box, idx=req["idx"], ids=req["body"]["input_ids"], sid=req["sid"],
                             loss_mask=req["loss_mask"], width=req["width"])
            reply = {"ok": {"nbytes": s.nbytes, "width": s.width, "answer_bytes": s.answer_bytes,
                              "topk_mass": s.topk_mass},
                     "latency_s": latency_s}
    except BadResponse as exc:
        reply = {"bad": exc.reason, "retry": exc.retry}
    except DiskError as exc:
        reply = {"disk": str(exc)}
    except Exception as exc:  # noqa: BLE001 - told to the client, which ends the run with it
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    reply["id"] = req["id"]
    send(reply)


def serve(fd_in: int, fd_out: int, parent: int) -> int:
    """The worker's loop: take requests, run up to `slots` of them at once, until the input closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent)
    from pipeline.extract.storing import StoreSpec

    setup = _read_json(fd_in)
    if setup is None:
        return 0
    spec = StoreSpec.from_json(setup["spec"])
    lock, local = threading.Lock(), threading.local()

    def send(reply: dict) -> None:
        with lock:
            try:
                _write_json(fd_out, reply)
            except OSError:  # the client is gone
                os._exit(0)

    pool = ThreadPoolExecutor(max_workers=max(1, setup["slots"]))
    send({"ready": os.getpid()})
    while True:
        req = _read_json(fd_in)
        if req is None:
            os._exit(0)  # the client closed: what is in flight is abandoned (see the module's note)
        pool.submit(_one, spec, req, local, setup, send)


class WorkerDied(Exception):
    """The worker ended while it held samples (killed, out of memory): they are tried again."""


class ParseWorker:
    """The client's end of one worker process. Start and close it on the thread that runs the
    event loop (PR_SET_PDEATHSIG follows the thread that started the worker); `request` is a
    coroutine, and a reader thread resolves the replies."""

    def __init__(self, spec, *, server: str, timeout_s: float, slots: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.extract.parse_worker", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self._in, self._out = self.stdin.fileno(), self.stdout.fileno()
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.gone: str | None = None
        try:
            _write_json(self._in, {"spec": spec.to_json(), "server": server, "timeout_s": timeout_s, "slots": slots})
        except OSError:
            pass  # died at start: the reader says how
        threading.Thread(target=self._read_replies, name=f"parse-worker-{self.proc.pid}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_replies(self) -> None:
        while True:
            try:
                reply = _read_json(self._out)
            except (OSError, ValueError):
                reply = None
            if reply is None:
                reason = self._death()
                self._call(self._fail_all, reason)
                self.stdout.close()
                return
            if "ready" not in reply:
                self._call(self._resolve, reply)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: the run is over
            pass

    def _resolve(self, reply: dict) -> None:
        fut = self.pending.pop(int(reply.get("id", -1)), None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _fail_all(self, reason: str) -> None:
        self.gone = reason
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(reason))

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"parse worker {self.proc.pid} stopped answering"
        if code < 0:
            name = signal.Signals(-code).name
            hint = " — out of memory? lower --max-inflight-gb" if -code == signal.SIGKILL else ""
            return f"parse worker {self.proc.pid} was killed by {name}{hint}"
        return f"parse worker {self.proc.pid} exited with status {code}"

    async def request(self, *, idx: int, body: dict, sid, loss_mask, width) -> dict:
        """Have the worker request, store and write one sample; its reply (`ok`, `bad`/`retry`,
        `disk`, `error`, `http` or `transport`). Raises WorkerDied when the worker is gone."""
        if self.gone:
            raise WorkerDied(self.gone)
        rid = next(self._ids)
        fut = self.loop.create_future()
        self.pending[rid] = fut
        try:
            _write_json(self._in, {"id": rid, "idx": idx, "body": body, "sid": sid, "loss_mask": loss_mask,
                                   "width": width})
        except OSError:
            self.pending.pop(rid, None)
            raise WorkerDied(self.gone or f"parse worker {self.proc.pid} is gone") from None
        try:
            return await fut
        finally:
            self.pending.pop(rid, None)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the worker (its input closes: it exits, abandoning what is in flight) and reap it."""
        try:
            self.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parent = int(argv[0]) if argv else os.getppid()
    out = os.dup(sys.stdout.fileno())  # the replies' pipe; anything printed goes to the client's log
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        return serve(sys.stdin.fileno(), out, parent)
    except BrokenPipeError:  # the client is gone
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
