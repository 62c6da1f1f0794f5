"""The draft's quality on the toy target: τ at depth 5 with the demo's training budget, and its baselines.

The demo's recipe (300 samples, 2-process CPU torchrun, 360 steps, lr 1e-2, 5-step TTT,
token budget 2,048), then `eagle3 eval-draft` against a fresh toy server: the draft's τ,
a bigram table's, and the same draft's with its aux features zeroed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, write_block
from bench.train_bench import ROOT, _extract
from pipeline.toy.demo_workspace import TRAIN_STEPS


def run(*, full: bool = True) -> list[str]:
    from pipeline.evaluate import evaluate
    from pipeline.toy.launch import ToyServer

    steps = TRAIN_STEPS if full else 120
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, target = _extract(tmp)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "pipeline.train", "--data", str(data), "--target-model", str(target), "--out",
                        str(tmp / "ckpt"), "--steps", str(steps), "--lr", "1e-2", "--ttt", "5", "--token-budget",
                        "2048", "--save-every", "1000"], check=True, capture_output=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - t
        server = ToyServer()
        try:
            r = evaluate(draft_dir=tmp / "ckpt" / "draft", server=server.url, data=tmp / "d.jsonl",
                         target_model=str(target), depth=5, prompts=48, new_tokens=64, say=lambda _m: None)
        finally:
            server.stop()
    acc = ", ".join(f"{a:.2f}" for a in r["accept_by_depth"])
    return ["## Draft quality on the toy target (issue 13)", "",
            f"{steps} steps of 2-process CPU training ({wall:.0f} s wall with start-up and export), exported to "
            f"SGLang's layout, measured by `eval-draft` at depth {r['depth']} (τ max {r['depth'] + 1}) on "
            f"{r['prompts_measured']} prompts' 64-token greedy continuations; the bigram table learned from "
            f"{r['bigram_learned_from']} other prompts.", "",
            "| drafter | τ |", "|---|---|",
            f"| trained draft | {r['tau']:.2f} |", f"| bigram table | {r['tau_bigram']:.2f} |",
            f"| trained draft, aux features zeroed | {r['tau_no_aux']:.2f} |", "",
            f"Acceptance by depth (given the earlier ones): {acc}.", ""]


def main(*, full: bool = True) -> int:
    """Write this section as its own block of bench/RESULTS.md, with the machine and date."""
    lines = run(full=full)
    stamp = (f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}"
             f"{'' if full else ' (BENCH_QUICK=1: 120 training steps)'}.")
    write_block("draft", [lines[0], "", stamp, *lines[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main(full=os.environ.get("BENCH_QUICK") != "1"))
