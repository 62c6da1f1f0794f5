"""`eagle3 toy-server`: a tiny SGLang-compatible target for the demo, tests and benchmarks.

It answers `/generate` in SGLang's response shape (see REFERENCE.md): with
`return_hidden_states`, `meta_info.hidden_states` is a list — the prefill's rows
(only the last chunk's under chunked prefill, as SGLang stores them), then one row
per decoded token. Default rows pack 3 aux layers + the final layer (a patched
server); `--stock` packs the 3 aux layers only and serves top-K logprobs, like
stock SGLang with aux capture. `/metrics` counts health checks as requests, as the
real counter does. Faults are injected by flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from pipeline.draft.capture import captured_layers
from pipeline.toy.model import HIDDEN, LAYERS, VOCAB, ToyLM, export_target


def _encoder() -> Callable[[Any], bytes]:
    """An answer's hidden states are ~1,000 floats a token: orjson writes them 20× faster than json (the same
    values); json where a `train` extra was installed before orjson joined it."""
    try:
        from orjson import dumps
    except ImportError:
        return lambda body: json.dumps(body).encode()
    return dumps


_dumps = _encoder()
VERSION = "0.5.23-toy"


class ToyState:
    """The model, options and counters shared by request threads."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.model = ToyLM()
        self.lock = threading.Lock()
        self.requests_total = 0
        self.generate_count = 0
        self.running = 0
        self.max_running = 0
        self.hang_until: float | None = None  # --hang-for: when the hang that began ends (monotonic)
        self.rng = random.Random(opts.seed)
        # the layers whose inputs are captured, as a Llama target in SGLang maps --return-aux-hidden-state-layer-ids
        self.capture = captured_layers(getattr(opts, "aux_layer_ids", None), LAYERS)

    def hang(self, for_s: float) -> None:
        """Block this request: for ever, or (`for_s` > 0) until `for_s` after the first hung request arrived;
        requests after that end are answered again."""
        if not for_s:
            threading.Event().wait()
        with self.lock:
            if self.hang_until is None:
                self.hang_until = time.monotonic() + for_s
            left = self.hang_until - time.monotonic()
        if left > 0:
            time.sleep(left)

    def layers(self) -> int:
        return 3 if self.opts.stock else 4

    def server_info(self) -> dict:
        o = self.opts
        return {"version": VERSION, "model_path": "toy-lm", "enable_return_hidden_states": True,
                "enable_return_aux_hidden_states": True, "return_aux_hidden_state_layer_ids": getattr(o, "aux_layer_ids", None),
                "hidden_states_layers": self.layers(), "disable_radix_cache": not o.radix_cache,
                "chunked_prefill_size": o.chunked_prefill_size, "speculative_algorithm": "EAGLE3",
                "tp_size": 1, "port": o.port, "num_hidden_layers": LAYERS}

    def generate(self, req: dict) -> tuple[int, dict]:
        ids = req.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < VOCAB for i in ids):
            return 400, {"error": {"message": f"input_ids must be a non-empty list of ids in 0..{VOCAB - 1}"}}
        params = req.get("sampling_params") or {}
        new_tokens = max(1, int(params.get("max_new_tokens", 1)))
        stop_ids = set(params.get("stop_token_ids") or [])
        temperature = float(params.get("temperature") or 0.0)
        finish = {"type": "length", "length": new_tokens}
        with self.lock:
            cache: list[dict] = [{} for _ in range(LAYERS)]  # keys and values: a decode step costs one position, as SGLang's
            aux, final, logits = self.model(ids, capture=self.capture, cache=cache)
            out_ids, rows_decode = [], []
            cur_logits = logits[-1]
            for step in range(new_tokens):
                if temperature > 0:  # sampled as SGLang does, from softmax(logits / T), by the server's seeded RNG
                    weights = torch.softmax(cur_logits.float() / temperature, -1).tolist()
                    tok = self.rng.choices(range(len(weights)), weights=weights)[0]
                else:
                    tok = int(cur_logits.argmax())
                if self.opts.answer_tokens and step + 1 >= self.opts.answer_tokens and stop_ids:
                    tok = min(stop_ids)  # --answer-tokens: a target that ends its answers (tests of multi-turn)
                out_ids.append(tok)
                if tok in stop_ids:  # SGLang keeps the matched stop token in output_ids
                    finish = {"type": "stop", "matched": tok}
                    break
                if step < new_tokens - 1:  # each decode forward yields one hidden row
                    a2, f2, l2 = self.model([tok], capture=self.capture, cache=cache)
                    if req.get("return_hidden_states"):
                        rows_decode.append(self._pack(a2, f2)[0])
                    cur_logits = l2[-1]
        meta = {"id": uuid.uuid4().hex, "finish_reason": finish,
                "prompt_tokens": len(ids), "completion_tokens": len(out_ids), "cached_tokens": 0}
        if req.get("return_hidden_states"):
            rows = self._pack(aux, final)
            chunk = self.opts.chunked_prefill_size
            if len(ids) > chunk:  # SGLang keeps only the last chunk's rows
                rows = rows[-(len(ids) % chunk or chunk):]
            if self.opts.wrong_rows_every and self.generate_count % self.opts.wrong_rows_every == 0:
                rows = rows[:-1]
            if self.opts.dump_dir:
                meta[self.opts.dump_field] = self._dump(rows, len(ids))
            else:
                meta["hidden_states"] = [rows.tolist(), *[r.tolist() for r in rows_decode]]
        if req.get("return_logprob"):
            meta.update(self._logprobs(ids, logits, out_ids, int(req.get("top_logprobs_num") or 0)))
        return 200, {"text": "", "output_ids": out_ids, "meta_info": meta}

    def _pack(self, aux: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        layers = aux if self.opts.stock else torch.cat([aux, final[:, None, :]], dim=1)
        return layers.reshape(layers.shape[0], -1)

    def _dump(self, rows: torch.Tensor, seq: int) -> str:
        from safetensors.torch import save_file

        path = Path(self.opts.dump_dir) / f"dump_{uuid.uuid4().hex}.safetensors"
        save_file({"hidden_states": rows.reshape(rows.shape[0], self.layers(), HIDDEN).to(torch.bfloat16).contiguous()},
                  str(path))
        return str(path)

    def _logprobs(self, ids: list[int], logits: torch.Tensor, out_ids: list[int], k: int) -> dict:
        logp = logits.log_softmax(-1)
        top = lambda row: [[float(v), int(i), None] for v, i in zip(*row.topk(k), strict=True)] if k else []  # noqa: E731
        # Entry j is the distribution that predicts token j; nothing predicts token 0.
        return {"input_token_logprobs": [[None, ids[0], None]] + [[float(logp[j - 1, ids[j]]), ids[j], None]
                                                                   for j in range(1, len(ids))],
                "input_top_logprobs": [None] + [top(logp[j - 1]) for j in range(1, len(ids))],
                "output_token_logprobs": [[float(logp[-1, out_ids[0]]), out_ids[0], None]],
                "output_top_logprobs": [top(logp[-1])]}


def make_handler(state: ToyState):
    """The request handler class bound to `state`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, code: int, body, ctype: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else _dumps(body)
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            with state.lock:
                state.requests_total += 1  # like SGLang's counter: health checks count too
            if self.path in ("/health", "/health_generate"):
                self._send(200, b"", "text/plain")
            elif self.path in ("/get_server_info", "/server_info"):
                self._send(200, state.server_info())
            elif self.path == "/get_model_info":
                self._send(200, {"model_path": "toy-lm", "is_generation": True})
            elif self.path.split("?", 1)[0] == "/v1/loads":  # SGLang 0.5.23's own view of its load
                self._send(200, _loads(state))
            elif self.path == "/metrics":
                self._send(200, _metrics(state).encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):  # noqa: N802
            if self.path != "/generate":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            length = int(self.headers.get("Content-Length") or 0)
            try:
                req = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            o = state.opts
            with state.lock:
                if getattr(o, "log_requests", None):  # what a client sent, for tests that check it
                    with open(o.log_requests, "a") as log:
                        log.write(json.dumps({"sampling_params": req.get("sampling_params"),
                                              "input_ids": req.get("input_ids")}) + "\n")
                state.requests_total += 1
                state.generate_count += 1
                n = state.generate_count
                state.running += 1
                state.max_running = max(state.max_running, state.running)
                fail = state.rng.random() < o.error_rate
            try:
                if o.crash_after and n > o.crash_after:
                    os._exit(1)
                if o.hang_after and n > o.hang_after:
                    state.hang(o.hang_for)
                if o.latency_ms:
                    time.sleep(o.latency_ms / 1000)
                if fail:
                    return self._send(500, {"error": {"message": "injected failure"}})
                code, body = state.generate(req) if not o.fixed_reply else (200, _fixed_reply(req))
                self._send(code, body)
            finally:
                with state.lock:
                    state.running -= 1

    return Handler


def _fixed_reply(req: dict) -> dict:
    """A cheap valid answer (benchmarks of the client, not of the model)."""
    n = len(req.get("input_ids") or [1])
    row = [0.0] * (4 * HIDDEN)
    return {"text": "", "output_ids": [0], "meta_info": {"id": "x", "prompt_tokens": n, "hidden_states": [[row] * n]}}


def _loads(state: ToyState) -> dict:
    """`GET /v1/loads` as SGLang 0.5.23 answers it (entrypoints/v1_loads.py): one load per DP rank."""
    with state.lock:
        running = state.running
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": "toy", "accelerator": None,
            "num_accelerators": 1, "loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                                              "num_used_tokens": 0, "max_running_requests": 64}]}


def _metrics(state: ToyState) -> str:
    label = '{model_name="toy-lm"}'
    return (f"sglang:num_running_reqs{label} {state.running}\nsglang:num_queue_reqs{label} 0\n"
            f"sglang:num_requests_total{label} {state.requests_total}\n"
            f"toy:max_running_reqs{label} {state.max_running}\ntoy:generate_total{label} {state.generate_count}\n")


def serve(opts: argparse.Namespace) -> int:
    """Run until killed."""
    if opts.export_target:
        export_target(Path(opts.export_target))
        print(f"wrote the toy target to {opts.export_target}")
        return 0
    torch.set_num_threads(1)
    state = ToyState(opts)
    server = ThreadingHTTPServer((opts.host, opts.port), make_handler(state))
    server.daemon_threads = True
    opts.port = server.server_address[1]
    print(f"toy-server: listening on http://{opts.host}:{opts.port} ({state.layers()} layers × {HIDDEN}, "
          f"chunked prefill {opts.chunked_prefill_size})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":  # python -m pipeline.toy.server: the flags of `eagle3 toy-server`
    import sys

    from pipeline.toy.args import add_arguments

    parser = argparse.ArgumentParser(prog="python -m pipeline.toy.server")
    add_arguments(parser)
    sys.exit(serve(parser.parse_args()))
