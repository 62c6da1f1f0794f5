"""Preflight: read /server_info before the first sample and refuse a useless server."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from pipeline.errors import UserError


@dataclass
class Plan:
    """What the server will return and how the client will store it."""

    layers: int  # L: layers per returned row
    final_present: bool
    topk: int  # 0 unless the final layer is absent
    chunk: int | None
    layer_ids: list
    version: str
    model: str
    warnings: list[str] = field(default_factory=list)


DEFAULT_TOPK = 256  # target logprobs per position when the final layer is absent: the distribution, not its head


def plan(info: dict, *, layers: int | None, topk: int | None, longest: int) -> Plan:
    """Decide L, final layer and top-K from the server's flags; refuse with one line per problem."""
    problems, warnings = [], []
    if not info.get("enable_return_hidden_states"):
        problems.append("hidden states are off: start the server with --enable-return-hidden-states")
    aux_ids = info.get("return_aux_hidden_state_layer_ids")
    if layers is None:
        if isinstance(info.get("hidden_states_layers"), int):
            layers = info["hidden_states_layers"]
        elif info.get("enable_return_aux_hidden_states"):
            layers = len(aux_ids) if isinstance(aux_ids, list) and aux_ids else 3
    if layers is None or layers < 3:
        problems.append("the server returns only the final layer; EAGLE-3 needs the 3 auxiliary layers: start it with "
                        "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 (or pass --layers)")
    if problems or layers is None:  # (no layer count is among the problems)
        raise UserError("server refused by preflight:\n  " + "\n  ".join(problems))
    final = layers >= 4
    k = 0 if final else (topk or DEFAULT_TOPK)
    if not info.get("disable_radix_cache"):
        warnings.append("the radix cache is on: a prefix hit returns only uncached rows; use --disable-radix-cache")
    chunk = info.get("chunked_prefill_size")
    if isinstance(chunk, int) and 0 < chunk < longest:
        warnings.append(f"--chunked-prefill-size {chunk} is below the longest sample ({longest} tokens): those samples "
                        "will come back short and be rejected")
    return Plan(layers=layers, final_present=final, topk=k, chunk=chunk if isinstance(chunk, int) and chunk > 0 else None,
                layer_ids=aux_ids if isinstance(aux_ids, list) else [], version=str(info.get("version", "unknown")),
                model=str(info.get("model_path", "unknown")), warnings=warnings)


def fetch_info(url: str, *, timeout_s: float = 30.0, wait_s: float = 0.0, say=None) -> dict:
    """GET /server_info (0.5.23's name; /get_server_info on older servers), waiting up to `wait_s`
    for a server that is still starting."""
    deadline = time.monotonic() + wait_s
    base = url.rstrip("/")
    while True:
        try:
            r = httpx.get(f"{base}/server_info", timeout=timeout_s)
            if r.status_code == 404:  # a server older than /server_info
                r = httpx.get(f"{base}/get_server_info", timeout=timeout_s)
            r.raise_for_status()
            info = r.json()
            break
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            if time.monotonic() >= deadline:
                raise UserError(f"{url}: cannot read /server_info ({type(exc).__name__}: {exc}); "
                                "is the server up?") from None
            if say:
                say(f"waiting for the server at {url} ({type(exc).__name__})")
                say = None
            time.sleep(1.0)
        except ValueError:
            raise UserError(f"{url}: /server_info did not return JSON; is this an SGLang server?") from None
    if not isinstance(info, dict):
        raise UserError(f"{url}: /server_info did not return an object")
    return info
