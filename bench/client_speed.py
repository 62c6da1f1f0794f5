"""The extraction client's CPU per million floats at the target's width (issue 54): where one answer's CPU goes,
phase by phase, and the whole client before and after, side by side in one run.

1. The profile: one answer of 512 tokens × 3 aux layers × H 7,168 with its top-K target logprobs (K = 20 and
   256), built as SGLang's ORJSONResponse writes it, through each phase of the parse worker's path in this process:
   receiving it over loopback HTTP from a stand-in server in another process (httpx's stream, the client before;
   `parse_worker.Http`'s readinto, now), finding the arrays in the bytes (the search for "]]" and the row count
   before; one find per row now), simdjson's parse (with the float64 → float32 copy), the rest of the answer through
   json.loads with the top-K rows, the float → bf16 conversion, the safetensors write and the manifest's row.
2. The client: `eagle3 extract` in its own process (1 parse worker, concurrency 8, budget 1 GB, 8 × 512 tokens),
   CPU of the client and its worker from wait4(), the client before (a git worktree of BEFORE) and now, alternating,
   at K = 20 and 256; `same files`: every sample file now equal bit for bit to the one before wrote.

`python -m bench.client_speed` writes its own block of bench/RESULTS.md (BENCH_BEFORE=<rev> to compare with
another revision than the one before the change).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, write_block
from bench.topk_cost import (
    answer,  # SGLang's answer with 3 aux layers and top-K logprobs, compact JSON
)

H, AUX, TOKENS = 7168, 3, 512
ROOT = Path(__file__).resolve().parent.parent
BEFORE = os.environ.get("BENCH_BEFORE", "bcd172a")  # the client before issue 54's changes


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


SERVE = """
import sys, time
sys.path.insert(0, {root!r})
from bench.extract_width import StandIn
s = StandIn(open({path!r}, "rb").read())
print(s.url, flush=True)
time.sleep(3600)
"""


def _stand_in(body: bytes, tmp: Path) -> tuple[subprocess.Popen, str]:
    path = tmp / f"answer-{len(body)}.json"
    path.write_bytes(body)
    p = subprocess.Popen([sys.executable, "-c", SERVE.format(root=str(ROOT), path=str(path))], stdout=subprocess.PIPE,
                         text=True)
    return p, p.stdout.readline().strip()


def _receive_before(url: str) -> bytearray:
    import httpx

    with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", "/generate", json={}) as r:
        content = bytearray()
        for chunk in r.iter_bytes():
            content += chunk
    return content


def _find_before(buf) -> None:
    """The search the client did before: the matrix's "]]", then its rows counted."""
    at = buf.find(b'"hidden_states"')
    end = buf.find(b"]]", at)
    buf.count(b"]", at, end)


def profile(k: int, url: str, tmp: Path, rounds: int) -> dict[str, float]:
    """Median CPU seconds per million floats of each phase of one answer."""
    from pipeline.extract import fastparse
    from pipeline.extract.parse_worker import Http
    from pipeline.extract.response import topk_rows
    from pipeline.extract.storing import captured_mass
    from pipeline.extract.writer import tensors_for, write_sample
    from pipeline.manifest import Manifest

    mfloats = TOKENS * AUX * H / 1e6
    out: dict[str, list[float]] = {}

    def timed(name: str, fn, *args, **kwargs):
        c = _cpu()
        r = fn(*args, **kwargs)
        out.setdefault(name, []).append((_cpu() - c) / mfloats)
        return r

    (tmp / "hidden_states").mkdir(exist_ok=True)
    manifest = Manifest(tmp)
    http = Http(url, 120)
    for _ in range(rounds):
        timed("receive, before (httpx stream)", _receive_before, url)
        buf = timed("receive, now (readinto)", http.post, "/generate", {})[1]
        timed("find the arrays, before (\"]]\" and a count)", _find_before, buf)
        at = buf.find(fastparse.KEY)
        outer = buf.find(b"[", at)
        inner = buf.find(b"[", buf.find(b"[", outer + 1) + 1)
        starts, ends = timed("find the arrays, now (a find per row)", fastparse._row_ends, buf, inner)
        rows = timed("simdjson parse (+ float32 copy)", fastparse._matrix, buf, starts, ends)
        rest = bytes(buf[:outer]) + b"[]" + bytes(buf[ends[-1] + 3:])
        meta = timed("the rest: json.loads", json.loads, rest)["meta_info"]
        topk = timed("the top-K rows", topk_rows, meta, seq=TOKENS, k=k)
        timed("top-K mass", captured_mass, topk[1])
        tensors = timed("float → bf16", tensors_for, token_ids=list(range(TOKENS)), rows=rows, layers=AUX,
                        dtype="bf16", topk=topk, loss_mask=None)
        timed("safetensors write", write_sample, tmp / "hidden_states" / "hs_0.safetensors", tensors, {"id": "x"})
        timed("manifest row", manifest.record, idx=0, sample_id="x", status="done", tokens=TOKENS, nbytes=1,
              attempts=1, error=None, now=time.time())
        del buf, rows, tensors
    http.close()
    manifest.close()
    return {name: statistics.median(v) for name, v in out.items()}


def _worktree(rev: str, tmp: Path) -> Path:
    path = tmp / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    return path


def _client_run(code: Path, url: str, data: Path, out: Path, k: int) -> float:
    """One `eagle3 extract` run of `code`'s client; its CPU (and its parse worker's) in seconds. Run again over a
    finished `out`, it does everything but the samples: its start-up, preflight and resume check."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    p = subprocess.Popen([sys.executable, "-m", "bot.cli", "extract", "--server", url, "--data", str(data), "--out",
                          str(out), "--concurrency", "8", "--max-inflight-gb", "1", "--parse-workers", "1",
                          "--target-topk", str(k)], cwd=code, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    err = p.stderr.read().decode()
    _, status, ru = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"extract ({code}) failed:\n{err[-2000:]}")
    return ru.ru_utime + ru.ru_stime


def clients(urls: dict[int, str], tmp: Path, rounds: int) -> dict:
    from bench.extract_width import _same_files

    before = _worktree(BEFORE, tmp)
    data = tmp / "d8.jsonl"
    with open(data, "w") as fh:
        for i in range(8):
            fh.write(json.dumps({"id": f"s{i}", "input_ids": [(i * 7 + j) % 1000 for j in range(TOKENS)]}) + "\n")
    mfloats = 8 * TOKENS * AUX * H / 1e6
    res: dict = {}
    try:
        for k, url in urls.items():
            cpu: dict[str, list[float]] = {"before": [], "now": [], "before-start": [], "now-start": []}
            same = True
            for r in range(rounds):
                outs = {}
                for label, code in (("before", before), ("now", ROOT)):
                    outs[label] = tmp / f"out-{k}-{label}-{r}"
                    whole = _client_run(code, url, data, outs[label], k)
                    start = _client_run(code, url, data, outs[label], k)  # nothing left to do: the fixed cost
                    cpu[label].append(whole / mfloats)
                    cpu[f"{label}-start"].append(start)
                same = same and _same_files(outs["before"], outs["now"])
            res[k] = {label: statistics.median(v) for label, v in cpu.items()} | {"same": same}
            for label in ("before", "now"):
                res[k][f"{label}-answers"] = res[k][label] - res[k][f"{label}-start"] / mfloats
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)
    return res


def main(full: bool = True) -> list[str]:
    rounds = 3 if full else 1
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        servers = {k: _stand_in(answer(k), tmp) for k in (20, 256)}
        try:
            prof = {}
            for k, (_, url) in servers.items():
                (tmp / f"p{k}").mkdir()
                prof[k] = profile(k, url, tmp / f"p{k}", rounds)
            runs = clients({k: url for k, (_, url) in servers.items()}, tmp, rounds)
        finally:
            for p, _ in servers.values():
                p.kill()
                p.wait()
    lines = ["## The extraction client's CPU per million floats (issue 54)", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}. One answer of "
             f"{TOKENS} tokens × {AUX} aux layers × H {H:,} with its top-K target logprobs, compact JSON as SGLang's "
             "ORJSONResponse writes it, served over loopback by a stand-in in another process. Medians of "
             f"{rounds} round(s).", "",
             "**Where one answer's CPU goes** (CPU seconds per million hidden floats, in this process, phase by "
             "phase; the rows marked *before* are what the client did before, for comparison):", "",
             "| phase | K = 20 | K = 256 |", "|---|---|---|"]
    now_total = {k: 0.0 for k in prof}
    for name in prof[20]:
        lines.append(f"| {name} | {prof[20][name]:.4f} | {prof[256][name]:.4f} |")
        if "before" not in name:
            for k in prof:
                now_total[k] += prof[k][name]
    lines += [f"| **sum of the phases now** | **{now_total[20]:.4f}** | **{now_total[256]:.4f}** |", "",
              "**The whole client**, `eagle3 extract` with 1 parse worker, concurrency 8, `--max-inflight-gb 1`, "
              f"8 × {TOKENS} tokens; CPU of the client and its worker per million hidden floats; *before* is "
              f"revision {BEFORE} run from a git worktree, alternating with this tree's:", "",
              "| K | before, whole run | now, whole run | before, the answers | now, the answers | now / before "
              "(the answers) | same files |", "|---|---|---|---|---|---|---|"]
    for k, r in runs.items():
        lines.append(f"| {k} | {r['before']:.3f} s | {r['now']:.3f} s | {r['before-answers']:.3f} s | "
                     f"{r['now-answers']:.3f} s | {r['now-answers'] / r['before-answers']:.2f} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    lines += ["", "*The whole run* counts the client's start-up (Python, imports, the server's preflight, the "
              "manifest) in 8 answers; *the answers* take it out: a second run over the finished output, which does "
              f"all of that and no sample, measured {runs[20]['now-start']:.2f} CPU-s now and "
              f"{runs[20]['before-start']:.2f} before; over a real run's thousands of answers it vanishes."]
    write_block("client_speed", lines)
    return lines


if __name__ == "__main__":
    print("\n".join(main(full="--quick" not in sys.argv)))
