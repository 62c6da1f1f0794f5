"""`make bench`: run every benchmark and write bench/RESULTS.md with the machine and date."""

from __future__ import annotations

import importlib
import os
import sys
import time

from bench.common import RESULTS, machine, write_block

SECTIONS = ["bench.scanner", "bench.status_path", "bench.diagnosis_bench", "bench.extract_bench", "bench.train_bench"]


def main() -> int:
    full = os.environ.get("BENCH_QUICK") != "1"
    lines = ["# Benchmark results", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}"
             f"{'' if full else ' (BENCH_QUICK=1: reduced sizes)'}. Ratios are measured side by side in one run; "
             "this machine is shared, so absolute times are noisy.", ""]
    for name in SECTIONS:
        print(f"bench: {name} …", file=sys.stderr, flush=True)
        t = time.perf_counter()
        lines += importlib.import_module(name).run(full=full)
        print(f"bench: {name} done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    write_block("bench", lines)
    from bench import (  # their own blocks: each refreshes alone with `python -m`
        client_speed,
        draft_bench,
        forensics_cost,
        tensorboard_read,
        topk_cost,
        train_kernels,
    )
    topk_cost.main(full=full)
    client_speed.main(full=full)
    tensorboard_read.main(full=full)
    train_kernels.main(full=full)
    draft_bench.main(full=full)
    forensics_cost.main(full=full)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
