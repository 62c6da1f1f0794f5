"""Parse workers: the extraction's parsing, validation and writing in processes of their own.

The client's request loop holds the GIL while it reads answers; parsing an answer at the target's
width (H = 7,168, 3 aux layers: 216 MB of JSON for 512 tokens) takes ~1.5 s of CPU, so in one process
one core caps the run at ~7.5 million floats a second. With `--parse-workers N` each answer is
handed to one of N worker processes (`python -m pipeline.extract.parse_worker`) over a pipe, which
runs `storing.store_answer` on it — the same function the threads run — and answers with one line.

The wire, both ways: a 4-byte big-endian length and that many bytes of JSON; a request is followed
by the answer's raw bytes (`size` of them). The first message to a worker is the run's StoreSpec.
A worker ignores SIGINT and SIGTERM (the client decides what is finished on a stop, and drains),
dies with the client (PR_SET_PDEATHSIG), and ends when its input closes.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys

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


def serve(fd_in: int, fd_out: int, parent: int) -> int:
    """The worker's loop: one request, one answer, until the input closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent)
    from pipeline.extract.response import BadResponse
    from pipeline.extract.storing import DiskError, StoreSpec, store_answer

    first = _read_json(fd_in)
    if first is None:
        return 0
    spec = StoreSpec.from_json(first)
    _write_json(fd_out, {"ready": os.getpid()})
    while True:
        req = _read_json(fd_in)
        if req is None:
            return 0
        content = bytearray(req["size"])
        if not _read_exact(fd_in, memoryview(content)):
            return 0
        box = [content]
        del content
        try:
            s = store_answer(spec, box, idx=req["idx"], ids=req["ids"], sid=req["sid"], loss_mask=req["loss_mask"],
                             width=req["width"])
            reply = {"ok": {"nbytes": s.nbytes, "width": s.width, "answer_bytes": s.answer_bytes}}
        except BadResponse as exc:
            reply = {"bad": exc.reason, "retry": exc.retry}
        except DiskError as exc:
            reply = {"disk": str(exc)}
        except Exception as exc:  # noqa: BLE001 - told to the client, which ends the run with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        box.clear()
        _write_json(fd_out, reply)


class WorkerDied(Exception):
    """The parse worker ended while it held a sample (killed, out of memory): the sample is retried."""


class ParseWorker:
    """The client's end of one worker process. `store` blocks (run it in a thread); start and
    close on the thread that owns the run (PR_SET_PDEATHSIG follows the thread that started it)."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.extract.parse_worker", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        try:
            _write_json(self._in, spec.to_json())
        except OSError:
            pass  # the worker died at start: the first store says so
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _reply(self):
        reply = _read_json(self._out)
        if reply is None:
            raise WorkerDied(self._death())
        return reply

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

    def store(self, box: list, *, idx: int, ids: list[int], sid, loss_mask, width) -> dict:
        """Hand the answer taken from `box` to the worker and wait for its reply (a dict: `ok`,
        `bad`/`retry`, `disk` or `error`). Raises WorkerDied when the worker is gone."""
        try:
            if not self.ready:
                self._reply()  # {"ready": pid}: the worker started and read the spec
                self.ready = True
            content = box.pop()
            head = {"idx": idx, "ids": ids, "sid": sid, "loss_mask": loss_mask, "width": width, "size": len(content)}
            _write_json(self._in, head)
            _write_all(self._in, content)
            del content  # sent: the worker holds it now
            return self._reply()
        except (BrokenPipeError, ConnectionResetError):
            raise WorkerDied(self._death()) from None

    def close(self, timeout_s: float = 10.0) -> None:
        """End the worker (its input closes; it finishes nothing new) and reap it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


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
