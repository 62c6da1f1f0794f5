"""What K costs (issue 51): one answer of H = 7,168 × 512 tokens × 3 aux layers, stored with its top-K target
logprobs, parsed and written by the client's own storing path (`store_answer`: simdjson split, rows checked,
top-K rows, bf16 conversion, safetensors write) at K = 20 (the old default) and K = 256 (the new one), side by
side in one process, alternating, median of the rounds. The answers are built as SGLang's ORJSONResponse writes
them ([logprob, token id, null] triples), so their byte sizes are the real transfer.

`python -m bench.topk_cost` writes its own block of bench/RESULTS.md.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, write_block

H, AUX, TOKENS = 7168, 3, 512


def answer(k: int) -> bytes:
    import numpy as np

    rng = np.random.default_rng(17)
    rows = rng.standard_normal((TOKENS, AUX * H), dtype=np.float32).tolist()
    top = [[[float(-0.01 * j - 0.5), j, None] for j in range(k)]]
    meta = {"id": "cached", "prompt_tokens": TOKENS, "hidden_states": [rows],
            "input_top_logprobs": [None] + top * (TOKENS - 1), "output_top_logprobs": top}
    return json.dumps({"text": "", "output_ids": [0], "meta_info": meta}, separators=(",", ":")).encode()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(rounds: int = 5) -> dict:
    from pipeline.extract.preflight import Plan
    from pipeline.extract.storing import StoreSpec, store_answer

    bodies = {k: answer(k) for k in (20, 256)}
    cpu: dict[int, list[float]] = {20: [], 256: []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in bodies:
            (Path(tmp) / f"k{k}" / "hidden_states").mkdir(parents=True)
        for _ in range(rounds):
            for k, body in bodies.items():
                spec = StoreSpec(out=Path(tmp) / f"k{k}", mode="inline", parser="fast", dtype="bf16",
                                 dump_field="", plan=Plan(layers=AUX, final_present=False, topk=k, chunk=None,
                                                          layer_ids=[2, 30, 57], version="bench", model="bench"))
                t = _cpu()
                store_answer(spec, [body], idx=0, ids=list(range(TOKENS)), sid="s", loss_mask=None, width=None)
                cpu[k].append(_cpu() - t)
    floats = TOKENS * AUX * H
    out = {}
    for k, body in bodies.items():
        s = statistics.median(cpu[k])
        out[k] = {"answer_mb": len(body) / 1e6, "cpu_s": s, "cpu_s_per_mfloat": s / (floats / 1e6)}
    out["bytes_ratio"] = out[256]["answer_mb"] / out[20]["answer_mb"]
    out["cpu_ratio"] = out[256]["cpu_s"] / out[20]["cpu_s"]
    return out


def main(full: bool = True) -> list[str]:
    r = measure(rounds=5 if full else 2)
    lines = ["## What K costs: top-K target logprobs at H 7,168 (issue 51)", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}. One answer of "
             f"{TOKENS} tokens × {AUX} aux layers × {H:,} (3 aux, no final layer: stock SGLang with aux capture), "
             "parsed and written by `store_answer` (the parse worker's path), K = 20 and K = 256 alternating in one "
             "process; median CPU of the rounds.", "",
             "| K | answer (MB) | CPU s per answer | CPU s per million hidden floats |", "|---|---|---|---|"]
    for k in (20, 256):
        lines.append(f"| {k} | {r[k]['answer_mb']:.1f} | {r[k]['cpu_s']:.3f} | {r[k]['cpu_s_per_mfloat']:.4f} |")
    lines += ["", f"K = 256 makes the answer {100 * (r['bytes_ratio'] - 1):.1f} % larger and its parse and write "
              f"{100 * (r['cpu_ratio'] - 1):+.1f} % in CPU against K = 20, measured side by side."]
    write_block("topk_cost", lines)
    return lines


if __name__ == "__main__":
    print("\n".join(main(full="--quick" not in sys.argv)))
