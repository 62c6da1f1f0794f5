"""What "why is it stuck?" costs (issue 52): gathering the evidence of a 2-rank gloo training stage that is busy —
every rank in a loop of matmuls and all_reduces, the flight recorder on, both cores of this machine taken — as the
notifier does at a stall (`forensics.gather`: py-spy on every process, the flight recorder's dump, the log's end).

Measured, side by side in one run, alternating windows of WINDOW_S with and without one gathering at the window's
start:
- the gathering's wall seconds and its CPU seconds (ours, and py-spy's as our children);
- the stage's work: rank 0's iterations per second in the windows with a gathering against those without (the CPU
  the gathering takes from the stage, on a machine the stage already fills);
for py-spy's non-blocking mode (what a stall gathers) and --native (what `eagle3 why --native` reads).

`python -m bench.forensics_cost` writes its own block of bench/RESULTS.md.
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

WINDOW_S = 4.0

RANK = """
import os, time, torch, torch.distributed as dist
from pipeline.train.flight import serve_dumps
dist.init_process_group("gloo")
serve_dumps(dist.get_rank(), "gloo")
x, n, last = torch.randn(192, 192), 0, time.time()
while True:
    y = x @ x
    dist.all_reduce(y[:1])
    n += 1
    if dist.get_rank() == 0 and time.time() - last >= 0.2:
        last = time.time()
        print(f"iters {last:.3f} {n}", flush=True)
"""


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _iters_at(log: Path, t: float) -> float | None:
    """Rank 0's iteration count at wall time `t`, interpolated from its log."""
    points = [(float(a), int(b)) for a, b in
              (line.split()[1:3] for line in log.read_text().splitlines() if line.startswith("iters "))]
    for (t0, n0), (t1, n1) in zip(points, points[1:], strict=False):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / max(1e-9, t1 - t0)
    return None


def measure(rounds: int) -> dict:
    from pipeline.config import load_workspace
    from pipeline.controller import Controller
    from pipeline.observe import forensics

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "rank.py").write_text(RANK)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(root / "rank.py")]
        cfg = root / "eagle3.toml"
        cfg.write_text(f'[stages.train]\nout = "ckpt"\nargv = {json.dumps(argv)}\n'
                       'env = { MASTER_ADDR = "127.0.0.1", GLOO_SOCKET_IFNAME = "lo", OMP_NUM_THREADS = "1" }\n')
        ws = load_workspace(cfg)
        ctl = Controller(workspace=ws)
        log = ws.log_path("train")
        try:
            ctl.start("train", force=True, by="bench")
            deadline = time.time() + 90
            while time.time() < deadline and not (log.exists() and log.read_text().count("iters ") > 10):
                time.sleep(0.2)
            time.sleep(2.0)  # past the start's noise
            rates: dict[str, list[float]] = {"quiet": [], "nonblocking": [], "native": []}
            wall: dict[str, list[float]] = {"nonblocking": [], "native": []}
            cpu: dict[str, list[float]] = {"nonblocking": [], "native": []}
            summaries: list[str] = []
            for _ in range(rounds):
                for mode in ("quiet", "nonblocking", "native"):
                    t0 = time.time()
                    if mode != "quiet":
                        c0 = _cpu()
                        ev = forensics.gather(ws, ctl.store, "train", native=mode == "native")
                        c1 = _cpu()
                        wall[mode].append(time.time() - t0)
                        cpu[mode].append((c1[0] - c0[0]) + (c1[1] - c0[1]))
                        summaries = summaries or ev.summary
                    time.sleep(max(0.0, t0 + WINDOW_S - time.time()))
                    time.sleep(0.3)  # rank 0's next log line, past the window's end
                    a, b = _iters_at(log, t0), _iters_at(log, t0 + WINDOW_S)
                    if a is not None and b is not None:
                        rates[mode].append((b - a) / WINDOW_S)
        finally:
            ctl.stop_all(grace_s=2)
            ctl.close()
    out: dict = {"summary": summaries}
    for mode in ("nonblocking", "native"):
        out[mode] = {"wall_s": statistics.median(wall[mode]), "cpu_s": statistics.median(cpu[mode]),
                     "rate": statistics.median(rates[mode])}
    out["quiet_rate"] = statistics.median(rates["quiet"])
    return out


def main(full: bool = True) -> list[str]:
    rounds = 5 if full else 2
    r = measure(rounds)
    q = r["quiet_rate"]
    lines = ["## What \"why is it stuck?\" costs: gathering on a busy 2-rank run (issue 52)", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}. A 2-rank gloo torchrun "
             "(flight recorder on) in a loop of 192×192 matmuls and all_reduces fills both cores; windows of "
             f"{WINDOW_S:.0f} s alternate: no gathering, one non-blocking gathering (what a stall gathers), one "
             f"--native gathering; {rounds} rounds, medians. The stage's work is rank 0's iterations per second "
             "in each window.", "",
             "| gathering | wall s | CPU s (ours + py-spy) | stage iterations/s in its window | against quiet windows |",
             "|---|---|---|---|---|",
             f"| none | — | — | {q:,.0f} | — |"]
    for mode, label in (("nonblocking", "py-spy non-blocking (at a stall)"), ("native", "py-spy --native (on request)")):
        m = r[mode]
        lines.append(f"| {label} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | {m['rate']:,.0f} | "
                     f"{100 * (m['rate'] / q - 1):+.1f} % |")
    lines += ["", "Its summary, as the alert's thread shows it:", ""] + [f"    {s}" for s in r["summary"]]
    write_block("forensics_cost", lines)
    return lines


if __name__ == "__main__":
    print("\n".join(main(full="--quick" not in sys.argv)))
