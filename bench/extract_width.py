"""Extraction at the target's real width (issue 17): client peak RSS and CPU per million floats.

A stand-in SGLang (`/server_info`, `/health`, `/generate`) serves one cached answer: H = 7,168 with the
3 aux layers (21,504 floats a token), the rows of a seeded float32 tensor through `.tolist()` and a
compact JSON encoder as SGLang's ORJSONResponse writes them, plus the top-20 logprobs the 3-layer
mode asks for. The client runs as `eagle3 extract` in its own process; its CPU (with its parse
workers', which it reaps) and the peak RSS of its largest process come from wait4(); the peak of
the client's and its workers' RSS summed is sampled every 20 ms. Runs follow each other in one
session: the json.loads path without a budget, then the fast path at several concurrencies, budgets
and numbers of parse workers. Every run's files are compared bit for bit with the first.

`python -m bench.extract_width` writes its own block of bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

H, AUX, TOKENS = 7168, 3, 512
ROOT = Path(__file__).resolve().parent.parent


def _answer(tokens: int) -> bytes:
    import torch

    g = torch.Generator().manual_seed(17)
    rows = torch.randn(tokens, AUX * H, generator=g).tolist()
    top = [[[-0.1 * k, k, None] for k in range(20)]]
    meta = {"id": "cached", "prompt_tokens": tokens, "hidden_states": [rows],
            "input_top_logprobs": [None] + top * (tokens - 1), "output_top_logprobs": top}
    return json.dumps({"text": "", "output_ids": [0], "meta_info": meta}, separators=(",", ":")).encode()


class StandIn:
    """Serves the cached answer to every /generate on 127.0.0.1."""

    INFO = {"enable_return_hidden_states": True, "enable_return_aux_hidden_states": True,
            "return_aux_hidden_state_layer_ids": [2, 30, 57], "disable_radix_cache": True,
            "chunked_prefill_size": 8192, "version": "stand-in", "model_path": f"stand-in-H{H}"}

    def __init__(self, body: bytes) -> None:
        info = json.dumps(self.INFO).encode()

        class Handler(BaseHTTPRequestHandler):
            def _send(self, raw: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):  # noqa: N802
                self._send(info if "server_info" in self.path else b"{}")

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._send(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _tree_rss(pid: int, stop: threading.Event, peak: list) -> None:
    """Sample the summed RSS of a process and its children until `stop`; the peak goes in peak[0]."""
    import psutil

    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return
    while not stop.wait(0.02):
        total = 0
        try:
            for q in [proc, *proc.children(recursive=True)]:
                try:
                    total += q.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            return
        peak[0] = max(peak[0], total)


def _client(url: str, data: Path, out: Path, *args: str) -> dict:
    """One `eagle3 extract` run: wall, peak RSS (largest process; client + workers summed) and CPU."""
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "bot.cli", "extract", "--server", url, "--data", str(data),
                          "--out", str(out), "--target-topk", "20", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=_tree_rss, args=(p.pid, stop, peak), daemon=True)
    sampler.start()
    err = p.stderr.read().decode()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    stop.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"extract {' '.join(args)} failed:\n{err[-2000:]}")
    return {"wall_s": wall, "rss_gb": ru.ru_maxrss * 1024 / 1e9, "tree_gb": peak[0] / 1e9,
            "cpu_s": ru.ru_utime + ru.ru_stime}


def _same_files(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    names = sorted(p.name for p in (a / "hidden_states").iterdir())
    if names != sorted(p.name for p in (b / "hidden_states").iterdir()):
        return False
    for n in names:
        x, y = load_file(a / "hidden_states" / n), load_file(b / "hidden_states" / n)
        if x.keys() != y.keys() or not all(torch.equal(x[k].view(-1).view(torch.uint8), y[k].view(-1).view(torch.uint8))
                                           for k in x):
            return False
    return True


T0, W1 = ["--parse-workers", "0"], ["--parse-workers", "1"]
RUNS = [  # (label, samples, extra flags)
    ("json.loads parser (the path before issue 17), no budget, threads", 8,
     ["--parser", "json", "--concurrency", "8", "--max-inflight-gb", "1000", *T0]),
    ("fast, no budget, threads", 8, ["--concurrency", "8", "--max-inflight-gb", "1000", *T0]),
    ("fast, budget 1 GB, threads", 8, ["--concurrency", "8", "--max-inflight-gb", "1", *T0]),
    ("fast, budget 1 GB, 1 parse worker", 8, ["--concurrency", "8", "--max-inflight-gb", "1", *W1]),
    ("fast, budget 1 GB, concurrency 1, 1 parse worker", 8, ["--concurrency", "1", "--max-inflight-gb", "1", *W1]),
    ("fast, budget 1 GB, concurrency 32, threads", 32, ["--concurrency", "32", "--max-inflight-gb", "1", *T0]),
    ("fast, budget 1 GB, concurrency 32, 1 parse worker", 32, ["--concurrency", "32", "--max-inflight-gb", "1", *W1]),
    ("fast, budget 4 GB, concurrency 32, 1 parse worker", 32, ["--concurrency", "32", "--max-inflight-gb", "4", *W1]),
    ("fast, budget 2 GB, threads", 8, ["--concurrency", "8", "--max-inflight-gb", "2", *T0]),
    ("fast, budget 2 GB, 2 parse workers", 8, ["--concurrency", "8", "--max-inflight-gb", "2", "--parse-workers", "2"]),
]


def run(*, full: bool = True) -> list[str]:
    body = _answer(TOKENS)
    server = StandIn(body)
    floats = TOKENS * AUX * H
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in {s for _, s, _ in RUNS}:
                with open(Path(tmp) / f"d{n}.jsonl", "w") as fh:
                    for i in range(n):
                        fh.write(json.dumps({"id": f"s{i}", "input_ids": [(i * 7 + j) % 1000 for j in range(TOKENS)]})
                                 + "\n")
            ref = None
            for k, (label, n, args) in enumerate(RUNS if full else RUNS[:3]):
                out = Path(tmp) / f"out{k}"
                r = _client(server.url, Path(tmp) / f"d{n}.jsonl", out, *args)
                same = None
                if n == 8:
                    ref = ref or out
                    same = out == ref or _same_files(ref, out)
                rows.append((label, n, r, same))
    finally:
        server.close()
    lines = ["## Extraction at the target's real width (issue 17)", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({_machine()}). A stand-in SGLang serves "
             f"one cached answer: {TOKENS} tokens × {AUX} aux layers × H = {H:,} ({AUX * H:,} floats a token, "
             f"{len(body) / 1e6:.0f} MB of compact JSON, {len(body) / floats:.1f} bytes a float), with top-20 "
             "logprobs, from a threaded HTTP server in the benchmark's process (which shares the 2 cores). The "
             "client is `eagle3 extract` in its own process; CPU (user + system, the client's and its parse "
             "workers') and the largest process's peak RSS from wait4(); client + workers: the peak of their "
             "RSS summed, sampled every 20 ms. Runs in this order in one session. `same files`: every sample "
             "file equal bit for bit to the first run's.", "",
             "| client | samples × tokens | peak RSS, largest process | peak RSS, client + workers | "
             "CPU per million floats | samples/s | same files |",
             "|---|---|---|---|---|---|---|"]
    for label, n, r, same in rows:
        lines.append(f"| {label} | {n} × {TOKENS} | {r['rss_gb']:.2f} GB | {r['tree_gb']:.2f} GB | "
                     f"{r['cpu_s'] / (n * floats / 1e6):.3f} s | "
                     f"{n / r['wall_s']:.2f} | {'—' if same is None else ('yes' if same else 'NO')} |")
    lines += ["", "Issue 17's bar (8 × 512 at concurrency 8, `--max-inflight-gb 1`): peak RSS ≤ 2 GB, CPU ≤ 0.15 s "
              "per million floats, every sample identical to today's client's. On 2 cores one parse worker is the "
              "default (cores − 1); the stand-in server's sends take CPU from the same 2 cores. A parse worker "
              "makes its requests itself: no answer passes through the client. The summed RSS is sampled, so it "
              "can miss a peak (it reads below the largest process's exact wait4() peak in some rows).", ""]
    return lines


def _machine() -> str:
    from bench.common import machine

    return machine()


def main() -> int:
    from bench.common import write_block

    write_block("extract-width", run())
    print("wrote bench/RESULTS.md (extract-width)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
