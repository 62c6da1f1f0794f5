"""`make drills`: the reliability drills with more trials; writes their counts to bench/RESULTS.md.

DRILL_TRIALS (default 20) sets the kill -9 trials; the other drills scale from it.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine, write_block
from tests.support import drill_harness as harness


def main() -> int:
    logging.getLogger("eagle3.notifier").setLevel(logging.ERROR)  # the outage drill's retries are expected
    n = int(os.environ.get("DRILL_TRIALS", "20"))
    base = Path(tempfile.mkdtemp(prefix="eagle3-drills-"))
    runs = [
        ("kill9", lambda: harness.kill9_serve(base, trials=n, real_trainer_trials=1)),
        ("crash", lambda: harness.server_crash(base, trials=max(1, n // 4))),
        ("disk", lambda: harness.disk_full(base, trials=max(1, n // 8)) if harness.can_mount() else None),
        ("slack", lambda: harness.slack_outage(base, trials=max(1, n // 2))),
        ("store", lambda: harness.corrupt_store(base)),
    ]
    tallies = []
    for name, run in runs:
        print(f"drills: {name} …", file=sys.stderr, flush=True)
        tally = run()
        if tally is None:
            print(f"drills: {name} skipped (needs root to mount a tmpfs)", file=sys.stderr)
            continue
        print(f"drills: {name}: {tally.trials} trials, {len(tally.problems)} problems, {tally.seconds:.0f} s",
              file=sys.stderr, flush=True)
        tallies.append(tally)
    lines = ["## Reliability drills (issue 9)", "",
             f"`make drills`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}; "
             f"DRILL_TRIALS={n}. Real processes in `init --demo` workspaces, Slack as a fake Web API on loopback.", "",
             "| drill | trials | faults injected | samples verified | messages delivered | sample duplicates "
             "| message duplicates | problems | time |", "|---|---|---|---|---|---|---|---|---|"]
    for t in tallies:
        lines.append(f"| {t.drill} | {t.trials} | {t.faults} | {t.samples_verified:,} | {t.messages_delivered:,} | "
                     f"{t.sample_duplicates} | {t.message_duplicates} | {len(t.problems)} | {t.seconds:.0f} s |")
    kill9 = next((t for t in tallies if t.phases), None)
    if kill9:
        lines += ["", "Where the kill -9 faults landed: " + ", ".join(f"{k} {v}" for k, v in sorted(kill9.phases.items()))
                  + ". The first trial uses the real 2-process `torchrun` trainer, the rest a stand-in that records "
                    "each launch."]
    problems = [f"- {t.drill}: {p}" for t in tallies for p in t.problems]
    lines += ["", "Problems found:" if problems else "No problem found.", *problems]
    write_block("drills", lines)
    print(f"wrote {RESULTS}; the drills' workspaces are kept in {base}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
