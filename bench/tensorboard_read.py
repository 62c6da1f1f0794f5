"""Reading TensorBoard event files as a progress source (issue 37): a 1-GiB event file, read incrementally.

The file holds what a trainer that also logs images writes: 1-MiB image events between scalar events. The
first read (catch-up) skips the image records by seeking; then each tick appends a few scalars (a trainer
logging every step at a 10-s monitor tick) and the read costs what was appended. Side by side on a smaller
file: TensorBoard's own `EventFileLoader`, which without TensorFlow checks every byte's CRC in Python.

`python -m bench.tensorboard_read` refreshes its block of RESULTS.md alone.
"""

from __future__ import annotations

import struct
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, write_block
from pipeline.observe.probes.tensorboard import TensorboardProgress, masked_crc

TICK_S = 10.0  # the monitor's default tick


def frame(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def scalar(step: int, tag: str = "train/loss") -> bytes:
    from tensorboard.compat.proto import event_pb2, summary_pb2

    return frame(event_pb2.Event(step=step, wall_time=time.time(), summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=1.0 / step)])).SerializeToString())


def image_record(size: int) -> bytes:
    """One image event of `size` bytes of encoded image (its CRC computed once: the bench repeats it)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    img = summary_pb2.Summary.Image(height=512, width=512, colorspace=3, encoded_image_string=b"\x89PNG" * (size // 4))
    return frame(event_pb2.Event(step=0, wall_time=1.0, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="samples", image=img)])).SerializeToString())


def write_file(path: Path, images: int, image_bytes: int) -> int:
    """Images and, after each, a loss and an lr scalar; returns the last step."""
    big = image_record(image_bytes)
    with open(path, "wb") as fh:
        for step in range(1, images + 1):
            fh.write(big)
            fh.write(scalar(step))
            fh.write(scalar(step, "train/lr"))
    return images


def cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def run(*, full: bool = True) -> list[str]:
    images = 1024 if full else 128  # 1 GiB (128 MiB quick)
    ticks, per_tick = 60, 5
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        runs.mkdir()
        path = runs / "events.out.tfevents.1.bench"
        last = write_file(path, images, 1 << 20)
        size = path.stat().st_size
        tb = TensorboardProgress(runs, tag="train/loss", loss_tag="train/loss")
        wall = time.perf_counter()
        catch_up = 0.0
        while True:  # a catch-up reads at most READ_PER_TICK a tick: the ticks it takes, summed
            catch_up += cpu(tb.read)
            if not tb.reader.behind:
                break
        wall = time.perf_counter() - wall
        assert tb.read().value["done"] == last
        costs = []
        with open(path, "ab") as fh:
            for _ in range(ticks):
                for _ in range(per_tick):
                    last += 1
                    fh.write(scalar(last))
                fh.flush()
                costs.append(cpu(tb.read))
        assert tb.read().value["done"] == last
        mean = sum(costs) / len(costs)
        # side by side on a 16-MiB file: TensorBoard's EventFileLoader against this reader, first read
        small = Path(tmp) / "small"
        small.mkdir()
        write_file(small / "events.out.tfevents.2.bench", 16, 1 << 20)
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        theirs = cpu(lambda: sum(1 for _ in EventFileLoader(str(small / "events.out.tfevents.2.bench")).Load()))
        ours = cpu(lambda: TensorboardProgress(small, tag="train/loss").read())
        # the dense case: a file of scalars only (every record parsed), as a long run logging every step writes
        dense = Path(tmp) / "dense"
        dense.mkdir()
        n = 200_000 if full else 50_000
        one = scalar(1)
        (dense / "events.out.tfevents.3.bench").write_bytes(one * n)  # the same record n times: CRCs once
        dense_mib = (dense / "events.out.tfevents.3.bench").stat().st_size / 2**20
        reader = TensorboardProgress(dense, tag="train/loss")
        dense_cpu = 0.0
        while True:
            dense_cpu += cpu(reader.read)
            if not reader.reader.behind:
                break
    return ["## TensorBoard event files as a progress source", "",
            f"A {size / 2**30:.2f}-GiB event file ({images:,} 1-MiB image events, each followed by a loss and an "
            f"lr scalar), read by `progress = \"tensorboard\"`:", "",
            "| what | measured |", "|---|---|",
            f"| first read (catch-up), CPU | {catch_up:.2f} s ({wall:.2f} s wall) |",
            f"| each later tick, {per_tick} scalars appended, CPU (mean of {ticks}) | {mean * 1000:.2f} ms |",
            f"| share of a core at the default {TICK_S:.0f}-s tick | {100 * mean / TICK_S:.3f} % |",
            f"| a scalars-only file, {n:,} records ({dense_mib:.1f} MiB), every record parsed: first read, CPU | "
            f"{dense_cpu:.2f} s ({n / max(dense_cpu, 1e-9):,.0f} records/s) |",
            f"| a 16-MiB file's first read: TensorBoard's `EventFileLoader` / this reader, CPU | "
            f"{theirs:.2f} s / {ours:.3f} s ({theirs / max(ours, 1e-9):,.0f}×) |", ""]


def main(*, full: bool = True) -> int:
    lines = run(full=full)
    stamp = f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}."
    write_block("tensorboard", [lines[0], "", stamp, *lines[1:]])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(full="--quick" not in sys.argv))
