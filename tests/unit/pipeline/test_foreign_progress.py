"""Progress from other tools' formats (issue 37): TensorBoard event files read incrementally (torn and damaged
records skipped, long ones never read), a JSON log with other field names, and each driving the ETA."""

from __future__ import annotations

import json
import struct

import pytest

from pipeline.observe.diagnosis import Diagnoser
from pipeline.observe.done import files_progress, not_done
from pipeline.observe.probes.files import FileScanner
from pipeline.observe.probes.progress import read_jsonl_progress
from pipeline.observe.probes.tensorboard import TensorboardProgress, masked_crc

pytestmark = pytest.mark.timeout(60)


def record(step: int, loss: float, *, tag: str = "train/loss", data: bytes | None = None) -> bytes:
    """One TFRecord-framed Event, as TensorBoard's writer frames it (a torn write is a prefix of this)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    if data is None:
        data = event_pb2.Event(step=step, wall_time=1.0, summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=loss)])).SerializeToString()
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def test_crc_is_tfrecords():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    for data in (b"", b"\x05\0\0\0\0\0\0\0", bytes(range(256))):
        assert masked_crc(data) == masked_crc32c(data)


def test_event_files_are_read_incrementally_whatever_the_writer_leaves(tmp_path):
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    runs = tmp_path / "runs"
    writer = SummaryWriter(log_dir=str(runs))
    for step in range(1, 6):
        writer.add_scalar("train/loss", 5.0 / step, global_step=step)
        writer.add_scalar("train/lr", 1e-4, global_step=step)
    writer.flush()
    tb = TensorboardProgress(runs, tag="train/loss", total=10, loss_tag="train/loss")
    first = tb.read()
    assert first.value["done"] == 5 and first.value["total"] == 10 and first.value["loss"] == pytest.approx(1.0)
    events = next(runs.glob("events.out.tfevents.*"))
    # an image between scalars (400 KB): too long to be a scalar, skipped by a seek
    writer.add_image("sample", np.random.default_rng(0).integers(0, 255, (3, 400, 400), dtype=np.uint8), 5)
    writer.add_scalar("train/loss", 0.5, global_step=6)
    writer.flush()
    assert tb.read().value["done"] == 6 and tb.reader.scalars.skipped == 1
    offset = tb.reader.files[events].offset
    assert offset == events.stat().st_size  # all of it consumed; the next read starts there
    # a torn last record: waits for the rest, never an error, never a half-read
    rec = record(7, 0.4)
    with open(events, "ab") as fh:
        fh.write(rec[:9])
    assert tb.read().value["done"] == 6 and tb.reader.files[events].offset == offset
    with open(events, "ab") as fh:
        fh.write(rec[9:-2])
    assert tb.read().value["done"] == 6
    with open(events, "ab") as fh:
        fh.write(rec[-2:] + record(8, 0, data=b"\xff" * 30) + record(8, 0.35))  # garbage in a well-framed record
    got = tb.read().value
    assert got["done"] == 8 and got["loss"] == pytest.approx(0.35) and got["skipped_records"] == 1
    # a restarted trainer's new file is picked up; a damaged header stops reading that file only
    (runs / "events.out.tfevents.2.host").write_bytes(record(9, 0.3) + b"\x00" * 12 + record(10, 0.2))
    assert tb.read().value["done"] == 9 and tb.reader.scalars.bad == 2
    writer.close()


def test_event_files_unknown_until_the_tag_then_the_total_from_a_tag(tmp_path):
    tb = TensorboardProgress(tmp_path / "runs", tag="train/loss", total_tag="train/total_steps")
    assert "no such directory" in tb.read().unknown
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "events.out.tfevents.1.h").write_bytes(record(3, 1.0, tag="train/acc"))
    assert "no 'train/loss' scalar" in tb.read().unknown
    with open(tmp_path / "runs" / "events.out.tfevents.1.h", "ab") as fh:
        fh.write(record(4, 1.0) + record(4, 500.0, tag="train/total_steps"))
    assert tb.read().value | {} == {"done": 4, "failed": 0, "total": 500, "unit": "steps", "loss": None,
                                    "skipped_records": 0}


def test_a_json_log_with_other_names_and_a_torn_last_line(tmp_path):
    log = tmp_path / "log.jsonl"
    fields = {"step": "global_step", "total": "max_steps", "loss": "train_loss"}
    log.write_text(json.dumps({"global_step": 7, "max_steps": 100, "train_loss": 0.7}) + "\n"
                   + json.dumps({"epoch": 1, "eval_loss": 0.9}) + "\n" + '{"global_step": 8, "max_st')
    got = read_jsonl_progress(log, fields).value
    assert (got["done"], got["total"], got["loss"], got["unit"]) == (7, 100, 0.7, "steps")
    assert "no line with a 'global_step' step" in read_jsonl_progress(tmp_path / "none.jsonl", fields).unknown


def test_done_when_rules():
    prog = {"done": 30, "total": 40}
    assert not_done(None, prog) is None and not_done({"rule": "exit0"}, {}) is None
    assert "step 30 of 40" in not_done({"rule": "exit0-and-total"}, prog)
    assert "total is unknown" in not_done({"rule": "exit0-and-total"}, {"done": 30})
    assert not_done({"rule": "exit0-and-total"}, {"done": 40, "total": 40}) is None
    assert "no file matches 'ckpt/*.pt'" in not_done({"rule": "file:ckpt/*.pt", "file": None}, prog)
    assert not_done({"rule": "file:ckpt/*.pt", "file": "/w/ckpt/a.pt"}, prog) is None


def test_each_format_drives_the_eta(tmp_path):
    """A step (or a sample file) every 10 s of the monitor's clock: from a quarter on, an ETA whose band holds
    the truth, from each format's own reader."""
    from torch.utils.tensorboard import SummaryWriter

    total = 80
    writer = SummaryWriter(log_dir=str(tmp_path / "runs"))
    tb = TensorboardProgress(tmp_path / "runs", tag="train/loss", total=total, loss_tag="train/loss")
    log = tmp_path / "log.jsonl"
    rows = tmp_path / "rows"
    scanner = FileScanner(str(rows), suffix=".ckpt")
    readers = {"tensorboard": tb.read,
               "jsonl": lambda: read_jsonl_progress(log, {"step": "global_step", "total": "max_steps"}),
               "files": lambda: files_progress(scanner.scan().value, total, clock=lambda: 0.0)}
    diagnosers = {name: Diagnoser(stage="train") for name in readers}
    for k in range(1, total // 2):
        writer.add_scalar("train/loss", 1.0 / k, global_step=k)
        writer.flush()
        with open(log, "a") as fh:
            fh.write(json.dumps({"global_step": k, "max_steps": total}) + "\n")
        (rows / f"rows_{k // 10}").mkdir(parents=True, exist_ok=True)  # SpecForge's grouped layout
        (rows / f"rows_{k // 10}" / f"data_{k}.ckpt").write_bytes(b"x")
        (rows / f"rows_{k // 10}" / f"data_{k + 1}.ckpt.tmp").write_bytes(b"x")  # in progress: not counted
        for name, read in readers.items():
            obs = {"t": 10.0 * k, "stage": "train", "process": {"alive": True, "cpu_s": 8.0 * k, "exit_code": None},
                   "progress": read().value}
            v = diagnosers[name].feed(obs)
            if k >= total // 4:
                truth = 10.0 * (total - k)
                assert v.verdict == "progressing" and v.eta_s is not None, (name, k, v.reasons, v.eta_note)
                assert v.eta_low_s <= truth <= v.eta_high_s and abs(v.eta_s - truth) <= 0.1 * truth, (name, k, v)
    writer.close()


def test_the_handoffs_fresh_read_catches_up_to_the_last_step(tmp_path, monkeypatch):
    """`finished` reads a long event file to its end (a fresh reader catches up over several reads), so an
    exit0-and-total training is not judged short because the first read stopped part way."""
    from pipeline.config import load_workspace
    from pipeline.observe import done
    from pipeline.observe.probes import tensorboard

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "events.out.tfevents.1.h").write_bytes(b"".join(record(k, 1.0 / k) for k in range(1, 301)))
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[stages.train]\nargv = ["true"]\nprogress = "tensorboard"\nprogress_dir = "runs"\n'
                   'progress_tag = "train/loss"\nprogress_total = 300\ndone_when = "exit0-and-total"\n')
    monkeypatch.setattr(tensorboard, "READ_PER_TICK", 2048)  # a few dozen records a read
    ws = load_workspace(cfg)
    assert done.finished(ws, "train") is None
    (runs / "events.out.tfevents.1.h").write_bytes(b"".join(record(k, 1.0 / k) for k in range(1, 300)))
    assert "step 299 of 300" in done.finished(ws, "train")


def test_the_handoffs_fresh_read_of_a_long_log_catches_up_too(tmp_path, monkeypatch):
    """The same catch-up for a log-regex source: a fresh tail reads a bounded amount a call."""
    from pipeline.config import load_workspace
    from pipeline.observe import done
    from pipeline.observe.probes import progress

    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[stages.train]\nargv = ["true"]\nprogress = "log-regex"\nlog = "train.log"\n'
                   'progress_regex = "step (?P<done>\\\\d+)/(?P<total>\\\\d+)"\ndone_when = "exit0-and-total"\n')
    (tmp_path / "train.log").write_text("".join(f"step {k}/300 loss 0.1\n" for k in range(1, 301)))
    monkeypatch.setattr(progress, "READ_PER_CALL", 512)
    assert done.finished(load_workspace(cfg), "train") is None


def test_a_reading_another_run_wrote_is_unknown_never_that_runs_figures(tmp_path):
    """The trainer's progress lines and the extraction's manifest name the run that wrote them: read for another
    run (a new training's first ticks, before the old training is moved aside; a new extraction still waiting for
    its server over an earlier run's complete manifest), they are unknown with the reason, never 100 %."""
    import json as _json
    import sqlite3

    from pipeline.manifest import SCHEMA
    from pipeline.observe.probes.progress import read_manifest, read_train_progress

    (tmp_path / "progress.jsonl").write_text(_json.dumps({"step": 60, "total_steps": 60, "run": "r1", "loss": 1.0})
                                             + "\n")
    assert read_train_progress(tmp_path, run="r1").value["done"] == 60
    old = read_train_progress(tmp_path, run="r2")
    assert old.value is None and "is run r1's" in old.unknown
    out = tmp_path / "out"
    out.mkdir()
    conn = sqlite3.connect(out / "manifest.sqlite", isolation_level=None)
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("samples_total", "2"), ("run", "r1")])
    conn.executemany("INSERT INTO samples (idx, status, tokens) VALUES (?, 'done', 5)", [(0,), (1,)])
    conn.close()
    assert read_manifest(out, run="r1").value["done"] == 2 and read_manifest(out).value["done"] == 2
    other = read_manifest(out, run="r2")
    assert other.value is None and "manifest.sqlite is run r1's" in other.unknown
