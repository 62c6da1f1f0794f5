"""The extraction's event-loop helpers: a cancellation is never lost, and the run's end never hangs."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.extract.client import end_tasks, wait_at_most

pytestmark = pytest.mark.timeout(30)


def test_a_cancel_that_arrives_with_the_event_is_not_lost():
    # The race that hung an extraction: a storer, being cancelled, gives its budget back (the event
    # is set) in the same loop iteration as the requester waiting for it is cancelled.
    async def main():
        ev = asyncio.Event()
        t = asyncio.create_task(wait_at_most(ev, 5.0))
        await asyncio.sleep(0.01)
        ev.set()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())


def test_the_wait_ends_at_its_time_or_at_the_event():
    async def main():
        ev = asyncio.Event()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await wait_at_most(ev, 0.05)
        assert 0.04 <= loop.time() - t0 < 1.0
        loop.call_later(0.01, ev.set)
        t0 = loop.time()
        await wait_at_most(ev, 5.0)
        assert loop.time() - t0 < 1.0

    asyncio.run(main())


def test_ending_the_workers_cancels_again_one_that_swallowed_the_first_cancel():
    async def stubborn(started: asyncio.Event):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass  # what Python 3.11's wait_for does in the race above
        await asyncio.sleep(60)  # and then waits for a job that never comes

    async def failed():
        raise RuntimeError("a worker that died")

    async def main():
        started = asyncio.Event()
        tasks = [asyncio.create_task(stubborn(started)), asyncio.create_task(failed()),
                 asyncio.create_task(asyncio.sleep(60))]
        await started.wait()
        await asyncio.wait_for(end_tasks(tasks, grace_s=0.1), 10)
        assert all(t.done() for t in tasks)

    asyncio.run(main())


def test_the_parse_workers_http_reads_answers_reopens_a_closed_keep_alive_and_names_transport_failures():
    """parse_worker.Http against a real socket server that closes each connection after its answer without
    saying so (a keep-alive the server dropped while idle): the next request opens a new one, once."""
    import socket
    import threading

    from pipeline.extract.parse_worker import Http, _request

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port, served = srv.getsockname()[1], []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                served.append(body)
                status = b"500 Internal Server Error" if b'"fail"' in body else b"200 OK"
                answer = b'{"meta_info": {"n": %d}}' % len(served)
                conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(answer)).encode() + b"\r\n\r\n" + answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        http = Http(f"http://127.0.0.1:{port}", 5.0)
        assert _request({"input_ids": [1, 2]}, http) == bytearray(b'{"meta_info": {"n": 1}}')
        assert _request({"input_ids": [3]}, http) == bytearray(b'{"meta_info": {"n": 2}}')  # a new connection
        assert _request({"fail": 1}, http) == {"http": 'server answered HTTP 500: {"meta_info": {"n": 3}}'}
        assert served[0] == b'{"input_ids":[1,2]}'
    finally:
        srv.shutdown(socket.SHUT_RDWR)  # wakes accept(): the port is closed once it returns
        srv.close()
    refused = _request({}, Http(f"http://127.0.0.1:{port}", 2.0))
    assert refused["transport"].startswith("ConnectionRefusedError"), refused
