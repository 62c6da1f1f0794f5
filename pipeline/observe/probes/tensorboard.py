"""Progress from TensorBoard event files: the scalars SpecForge (and most trainers) report.

An event file is a TFRecord stream: per record an 8-byte length, a 4-byte masked CRC of it, the
serialized `Event`, and a 4-byte CRC of that. Records are parsed by TensorBoard's own protobuf
definitions (`tensorboard.compat.proto.event_pb2`, with the C protobuf runtime); the framing is read
here rather than through `EventFileLoader` because without TensorFlow installed that loader checks
every byte's CRC in pure Python (bench/tensorboard_read.py measures it), which on a multi-GB event file
of images and histograms costs minutes of a core on the first read. Here:
- files are read **incrementally**: each file's offset is kept, and a tick reads only what was appended
  (a catch-up on a long file is spread over ticks: at most 64 MiB and 0.5 s a tick);
  new files under the directory (a restarted trainer's) are picked up;
- a record longer than `MAX_SCALAR_RECORD` cannot be a scalar summary (an image, a histogram, a graph):
  it is skipped by a seek, never read;
- a **torn last record** (the writer is mid-write, or was killed there) is left for the next tick; a
  record whose header CRC fails, or that does not parse, is skipped and counted, never an error;
- a scalar is read from `simple_value` (torch's `SummaryWriter.add_scalar`) or from a one-element float
  tensor (`new_style=True`, and TensorFlow 2's `tf.summary.scalar`).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.observe.probes import Reading, known, unknown

EVENT_GLOB = "events.out.tfevents."
MAX_SCALAR_RECORD = 64 * 1024  # a scalar summary is ~100 bytes; anything this long is something else
READ_PER_TICK = 64 << 20  # at most this much read per file per tick while catching up (the rest next tick) …
READ_BUDGET_S = 0.5  # … and at most this long: a file of scalars only is ~170,000 records a second (bench/)
MAX_DEPTH = 3  # event files this deep under progress_dir at most (SpecForge: output_dir/runs/)

_CRC_TABLE: list[int] = []


def _crc32c(data: bytes) -> int:
    if not _CRC_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC_TABLE.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32-C (used here for the 8-byte length headers only)."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@dataclass
class _File:
    offset: int = 0
    inode: int | None = None
    damaged: bool = False  # a length header failed its CRC: nothing after it is framed


@dataclass
class Scalars:
    """The last value of each watched tag: tag → (step, value, wall time)."""

    last: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    records: int = 0  # records parsed
    skipped: int = 0  # records skipped: too long to be a scalar, or unreadable
    bad: int = 0  # of those, unreadable (header CRC, parse)


class EventScalars:
    """Reads the scalars `tags` from every event file under `directory`, incrementally."""

    def __init__(self, directory: Path, tags: set[str]) -> None:
        self.directory, self.tags = Path(directory), set(tags)
        self.files: dict[Path, _File] = {}
        self.scalars = Scalars()
        self.behind = False  # the last read stopped at READ_PER_TICK with more to read

    def _event_files(self) -> list[Path]:
        found = []
        base = len(self.directory.parts)
        for root, dirs, names in os.walk(self.directory):
            if len(Path(root).parts) - base >= MAX_DEPTH:
                dirs[:] = []
            found += [Path(root) / n for n in names if n.startswith(EVENT_GLOB)]
        return sorted(found)

    def read(self) -> Scalars:
        """Read what was appended since the last call; raises OSError only when the directory is unreadable."""
        from tensorboard.compat.proto import event_pb2

        if not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory}: no such directory")
        self.behind = False
        self._deadline = time.monotonic() + READ_BUDGET_S
        for path in self._event_files():
            state = self.files.setdefault(path, _File())
            if state.damaged:
                continue
            try:
                self._read_file(path, state, event_pb2)
            except OSError:
                continue  # removed between the listing and the open: gone next tick
        return self.scalars

    def _read_file(self, path: Path, state: _File, event_pb2) -> None:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_ino != state.inode or st.st_size < state.offset:  # replaced or truncated: from the start
                state.inode, state.offset = st.st_ino, 0
            end = min(st.st_size, state.offset + READ_PER_TICK)
            fh.seek(state.offset)
            pos = state.offset
            n = 0
            while pos + 12 <= end:
                n += 1
                if n % 4096 == 0 and time.monotonic() > self._deadline:
                    self.behind = True  # the rest next tick
                    break
                header = fh.read(12)
                if len(header) < 12:
                    break
                length, crc = struct.unpack("<QI", header)
                if masked_crc(header[:8]) != crc:  # not a record boundary: the file is damaged here
                    self.scalars.bad += 1
                    self.scalars.skipped += 1
                    state.damaged = True  # the values read so far stand; a new file (a restart) is read
                    return
                if pos + 12 + length + 4 > st.st_size:
                    break  # torn: the writer has not finished it; read it whole next tick
                if length > MAX_SCALAR_RECORD:
                    fh.seek(length + 4, os.SEEK_CUR)
                    self.scalars.skipped += 1
                else:
                    self._parse(fh.read(length), event_pb2)
                    fh.seek(4, os.SEEK_CUR)
                pos += 12 + length + 4
            state.offset = pos
            self.behind = self.behind or end < st.st_size

    def _parse(self, data: bytes, event_pb2) -> None:
        try:
            event = event_pb2.Event.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError; one bad record is skipped
            self.scalars.bad += 1
            self.scalars.skipped += 1
            return
        self.scalars.records += 1
        if not event.HasField("summary"):
            return
        for value in event.summary.value:
            if value.tag not in self.tags:
                continue
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                v = float(value.simple_value)
            elif kind == "tensor" and len(value.tensor.float_val) == 1:
                v = float(value.tensor.float_val[0])
            elif kind == "tensor" and len(value.tensor.double_val) == 1:
                v = float(value.tensor.double_val[0])
            else:
                continue
            prev = self.scalars.last.get(value.tag)
            if prev is None or event.step >= prev[0]:
                self.scalars.last[value.tag] = (int(event.step), v, float(event.wall_time))


class TensorboardProgress:
    """A stage's progress from its event files: the step of `tag`, the total, and the loss."""

    def __init__(self, directory: Path | None, *, tag: str, total: int | None = None, total_tag: str | None = None,
                 loss_tag: str | None = None, clock=time.time) -> None:
        self.clock, self.tag, self.total, self.total_tag, self.loss_tag = clock, tag, total, total_tag, loss_tag
        self.reader = (EventScalars(directory, {t for t in (tag, total_tag, loss_tag) if t})
                       if directory is not None else None)
        # the sampler runs probes under a time budget and starts the next tick while a slow read (a long
        # catch-up on a busy filesystem) may still be running: one read at a time
        self.lock = threading.Lock()

    @property
    def behind(self) -> bool:
        """The last read stopped short of the files' end (a catch-up continues next call)."""
        return self.reader is not None and self.reader.behind

    def read(self) -> Reading:
        if self.reader is None:
            return unknown("progress_dir is not configured", clock=self.clock)
        if not self.lock.acquire(blocking=False):
            return unknown(f"{self.reader.directory}: the previous read of its event files is still running",
                           clock=self.clock)
        try:
            return self._read()
        finally:
            self.lock.release()

    def _read(self) -> Reading:
        reader = self.reader
        if reader is None:  # (read() says so before it takes the lock)
            return unknown("progress_dir is not configured", clock=self.clock)
        try:
            s = reader.read()
        except ImportError:
            return unknown("progress = \"tensorboard\" needs the tensorboard package: "
                           "pip install 'eagle3-ops[tensorboard]'", clock=self.clock)
        except OSError as exc:
            return unknown(f"progress_dir {reader.directory}: {exc.strerror or exc}", clock=self.clock)
        last = s.last.get(self.tag)
        if last is None:
            return unknown(f"{reader.directory}: no {self.tag!r} scalar in its event files yet"
                           + (" (still reading a long file)" if reader.behind else ""), clock=self.clock)
        total = self.total
        if total is None and self.total_tag and self.total_tag in s.last:
            total = int(s.last[self.total_tag][1])
        loss = s.last.get(self.loss_tag) if self.loss_tag else None
        return known({"done": last[0], "failed": 0, "total": total, "unit": "steps",
                      "loss": loss[1] if loss else None, "skipped_records": s.bad}, clock=self.clock)
