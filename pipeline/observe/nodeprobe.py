"""`eagle3 probe` (`python -m pipeline.observe.nodeprobe`, the same program): run on a Slurm job's nodes by
the monitor and by "why is it stuck?", through `srun --overlap`; prints one JSON line for this node: the job's
processes, GPUs and files here (pipeline/observe/probes/remote.py), and with --stacks their Python stacks
(pipeline/observe/forensics.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.observe.forensics import PYSPY_TIMEOUT_S, node_stacks
from pipeline.observe.probes.remote import node_name, node_reading
from pipeline.stages.logfile import tail_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`eagle3 probe`'s flags."""
    parser.add_argument("--json", action="store_true", help="one JSON line (the only output there is)")
    parser.add_argument("--job", required=True, help="the Slurm job id whose processes are read")
    parser.add_argument("--files", default=None, metavar="DIR", help="the stage's output directory: its files counted")
    parser.add_argument("--suffix", default="", help="only files with this suffix")
    parser.add_argument("--fake-gpus", type=int, default=0, metavar="N", help="N idle scripted GPUs in place of NVML")
    parser.add_argument("--stacks", action="store_true", help="the processes' Python stacks (py-spy) instead")
    parser.add_argument("--native", action="store_true", help="with --stacks: native frames too (pauses each process)")
    parser.add_argument("--timeout", type=float, default=PYSPY_TIMEOUT_S, metavar="S", help="with --stacks: py-spy's bound")
    parser.add_argument("--flight-dir", default=None, metavar="DIR",
                        help="with --stacks: knock on this node's ranks' flight recorders in DIR first")
    parser.add_argument("--tail", default=None, metavar="FILE", help="the last --lines lines of FILE instead")
    parser.add_argument("--lines", type=int, default=50, metavar="N", help="with --tail: how many (default 50)")


def main(args: argparse.Namespace) -> int:
    """Print this node's reading of the job as one JSON line."""
    if args.tail:
        try:
            out = {"node": node_name(), "lines": tail_lines(Path(args.tail), args.lines)}
        except OSError as exc:
            out = {"node": node_name(), "error": f"{args.tail}: {exc.strerror or exc}"}
    elif args.stacks:
        out = node_stacks(args.job, native=args.native, timeout_s=args.timeout, flight_dir=args.flight_dir)
    else:
        out = node_reading(args.job, files_dir=args.files, suffix=args.suffix, fake_gpus=args.fake_gpus)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="eagle3 probe")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
