"""Status path: building `eagle3 status` from the store at 1,000 and 1,000,000 observations."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from bench.common import percentile, timed
from pipeline.config import Workspace, parse_config
from pipeline.controller import Controller
from pipeline.store import KV, Store
from pipeline.toy.simtrace import Scenario, simulate
from pipeline.verdict import StoredVerdict, Verdict


def _fill(store: Store, n: int) -> None:
    template = simulate(Scenario("bench", samples=200)).observations
    rows = []
    for i in range(n):
        obs = dict(template[i % len(template)], t=1_790_000_000.0 + i * 10 / 3, stage=("server", "extract", "train")[i % 3])
        rows.append((obs["t"], obs["stage"], "r1", json.dumps(obs)))
        if len(rows) == 50_000:
            store.db.conn.executemany("INSERT INTO observations (t, stage, run_id, data) VALUES (?, ?, ?, ?)", rows)
            rows = []
    if rows:
        store.db.conn.executemany("INSERT INTO observations (t, stage, run_id, data) VALUES (?, ?, ?, ?)", rows)
    for stage in ("server", "extract", "train"):
        pid = store.insert_proc({"run_id": "r1", "stage": stage, "state": "exited", "pid": 1, "pgid": 1,
                                 "create_time": 1.0, "started_at": 1.0, "ended_at": 2.0, "exit_code": 0,
                                 "argv": "[]", "log": "x", "stop_requested": 0})
        store.put_verdict(stage, StoredVerdict(t=2.0, stage=stage, verdict=Verdict.DONE, reasons=("exited 0",),
                                               progress_pct=100.0, proc_id=pid, final=True))
    store.put(KV.MONITOR, {"t": 1e12})


def _open(tmp: str, n: int) -> tuple[Controller, Store]:
    ws = Workspace(config=parse_config('[slack]\nallowed_user_ids = ["UOK"]\n', name="eagle3.toml"),
                   path=Path(tmp) / "eagle3.toml")
    store = Store(ws.store_path)
    _fill(store, n)
    return Controller(workspace=ws, store=store), store


def run(*, full: bool = True) -> list[str]:
    """Both stores open at once; calls alternate between them so drift hits both alike."""
    big_n = 1_000_000 if full else 100_000
    with tempfile.TemporaryDirectory() as t1, tempfile.TemporaryDirectory() as t2:
        (small, s_store), (big, b_store) = _open(t1, 1000), _open(t2, big_n)
        times: dict[int, list[float]] = {1000: [], big_n: []}
        latest: dict[int, list[float]] = {1000: [], big_n: []}
        for _ in range(1000):
            for n, ctl, store in ((1000, small, s_store), (big_n, big, b_store)):
                times[n] += timed(ctl.status)
                latest[n] += timed(lambda st=store: st.latest_observation(random.choice(["server", "extract", "train"])))
        slack = _slack_requests({1000: small.ws, big_n: big.ws})
        small.close()
        big.close()
        s_store.close()
        b_store.close()
    lines = ["## Status path (issue 3)", "",
             "`Controller.status()` (store reads and stage verification; no probe, no NVML, no network), 1,000 calls "
             "on each store, alternating between the two stores in one run.", "",
             "| observations | status p50 | status p99 | latest observation p99 | target |", "|---|---|---|---|---|"]
    for n in (1000, big_n):
        lines.append(f"| {n:,} | {percentile(times[n], 50) * 1e3:.2f} ms | {percentile(times[n], 99) * 1e3:.2f} ms | "
                     f"{percentile(latest[n], 99) * 1e3:.3f} ms | p99 ≤ 50 ms |")
    ratio = percentile(times[big_n], 99) / percentile(times[1000], 99)
    lines += ["", f"p99 at {big_n:,} is {ratio:.2f}× the p99 at 1,000 (target: within 1.2×). The status path reads the "
              "latest verdict and process rows only; the observation table's size does not enter it.", "",
              "As Slack drives it (issue 15): a signed `/eagle3 status` POSTed over loopback HTTP to `serve --http`'s "
              "app (threaded WSGI server, Bolt, the listener's store opened without the integrity check), request "
              "to answer, 300 requests a store, alternating.", "",
              "| observations | p50 | p99 | target |", "|---|---|---|---|"]
    for n in (1000, big_n):
        lines.append(f"| {n:,} | {percentile(slack[n], 50) * 1e3:.1f} ms | {percentile(slack[n], 99) * 1e3:.1f} ms | "
                     "p99 ≤ 50 ms |")
    return lines + [""]


def _slack_requests(workspaces: dict[int, Workspace], rounds: int = 300) -> dict[int, list[float]]:
    """Request-to-answer times of signed slash commands through the real HTTP transport."""
    import hashlib
    import hmac
    import logging
    import time
    from urllib.parse import urlencode

    import httpx

    from bot.app import build_app, serve_http
    from tests.support.fake_slack import FakeSlack

    logging.getLogger("eagle3.app").setLevel(logging.WARNING)
    secret = "bench-secret"
    servers, urls = [], {}
    fake = FakeSlack()  # Bolt's authorization needs auth.test once; a status answer needs nothing else
    for n, ws in workspaces.items():
        app = build_app(ws=ws, token="xoxb-bench", signing_secret=secret, api_url=fake.url + "/api/")
        srv = serve_http(app, signing_secret=secret, port=0)
        servers.append(srv)
        urls[n] = f"http://127.0.0.1:{srv.server_address[1]}/slack/events"
    body = urlencode({"command": "/eagle3", "text": "status", "user_id": "UOK", "channel_id": "C1", "team_id": "T1",
                      "response_url": "http://127.0.0.1:9/hook", "trigger_id": "1", "api_app_id": "A1"})
    out: dict[int, list[float]] = {n: [] for n in workspaces}
    try:
        with httpx.Client(timeout=10) as client:
            for i in range(rounds + 10):
                for n, url in urls.items():
                    ts = str(int(time.time()))
                    sig = "v0=" + hmac.new(secret.encode(), f"v0:{ts}:{body}".encode(), hashlib.sha256).hexdigest()
                    t = time.perf_counter()
                    r = client.post(url, content=body, headers={"Content-Type": "application/x-www-form-urlencoded",
                                                                "X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig})
                    dt = time.perf_counter() - t
                    if r.status_code != 200:
                        raise RuntimeError(f"status request answered {r.status_code}: {r.text[:200]}")
                    if i >= 10:  # warm-up: first connections, Bolt's lazy imports
                        out[n].append(dt)
    finally:
        for srv in servers:
            srv.shutdown()
        fake.close()
    return out
