"""The trainer's step on the CPU, side by side: the first (dense) implementation against the fast one (issue 33).

Forward and backward of the draft (7 unrolled steps, hidden 256, 8 heads / 2 KV heads, draft vocabulary 1,024)
on 2 samples of T tokens, each in its own process so its peak memory (ru_maxrss) is its own. The reference
is tests/support/reference_train.py (T×T scores in float32, repeated K/V, float32 log-softmax copies); the fast
one is pipeline/train (flash kernel merged through the log-sum-exp, soft cross-entropy on the logits).
`python -m bench.train_kernels` refreshes its block in bench/RESULTS.md. The GPU figures are bench/gpu_train.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, write_block

ROOT = Path(__file__).resolve().parents[1]

LENGTHS = (512, 1024, 2048)


def _child(kind: str, T: int) -> None:
    import resource

    import torch

    from pipeline.train.model import DraftConfig, Eagle3Draft, build_target, draft_vocab
    from tests.support import reference_train as ref

    torch.set_num_threads(2)
    torch.manual_seed(0)  # the draft's own initialisation: the same weights in both processes
    cfg = DraftConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, intermediate_size=512, vocab_size=4096, draft_vocab_size=1024)
    g = torch.Generator().manual_seed(0)
    m = Eagle3Draft(cfg, torch.randn(4096, 256, generator=g) * 0.02)
    m.set_vocab(*draft_vocab(torch.randint(0, 100, (4096,), generator=g), 1024))
    batch = {"token_ids": torch.randint(0, 4096, (2, T), generator=g), "aux": torch.randn(2, T, 768, generator=g),
             "final": torch.randn(2, T, 256, generator=g), "mask": torch.ones(2, T, dtype=torch.bool)}
    tgt = build_target(batch, m, torch.randn(4096, 256, generator=g))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        t = time.perf_counter()
        m.zero_grad()
        if kind == "fast":
            loss = m(batch, tgt, steps=7)[0]
        else:
            loss = ref.step_losses(ref.unroll(m, batch["aux"], batch["token_ids"], batch["mask"], 7), tgt)[0]
        loss.backward()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"s": min(times[1:]), "step_mb": (peak - before) / 1024, "loss": loss.item()}))


def measure(kind: str, T: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.train_kernels", "--child", kind, str(T)], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(*, full: bool = True) -> list[str]:
    lines = ["## The trainer's step on the CPU: reference against fast (issue 33)", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}. Forward + backward of "
             "the 7-step unroll, 2 samples of T tokens, hidden 256, 8 heads / 2 KV heads, draft vocabulary 1,024; "
             "the faster of 2 steps after one warm-up; memory is the process's peak RSS growth over those steps.",
             "", "| T | reference | fast | speed-up | reference memory | fast memory | same loss |",
             "|---|---|---|---|---|---|---|"]
    for T in LENGTHS if full else LENGTHS[:2]:
        old, new = measure("reference", T), measure("fast", T)
        same = abs(old["loss"] - new["loss"]) < 1e-4
        lines.append(f"| {T:,} | {old['s']:.2f} s | {new['s']:.2f} s | {old['s'] / new['s']:.1f}× | "
                     f"{old['step_mb']:,.0f} MB | {new['step_mb']:,.0f} MB | {'yes' if same else 'NO'} |")
    return lines + ["", "The GPU figures (tokens/s, share of the bf16 peak, phases) come from `bench/gpu_train.py` on "
                    "a GPU host; none was available where this ran.", ""]


def main(*, full: bool = True) -> None:
    write_block("train_kernels", run(full=full))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], int(sys.argv[3]))
    else:
        main(full="--quick" not in sys.argv)
