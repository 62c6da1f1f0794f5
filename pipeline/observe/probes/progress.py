"""Progress readers: each stage's own authority, never the server's counters."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from pathlib import Path

from pipeline.manifest import summarize
from pipeline.observe.latency import LatencyProfile
from pipeline.observe.probes import Reading, known, unknown
from pipeline.stages.logfile import tail_lines
from pipeline.train.outdir import accepted_length


def read_manifest(out_dir: Path | None, *, clock=time.time, stage: str = "extract", run: str | None = None) -> Reading:
    """Extraction (or regeneration) progress from its manifest.sqlite in `out_dir`: unknown while the manifest
    is another run's (`run` given, and the manifest records that an earlier run wrote it), never that run's
    figures as this run's."""
    if out_dir is None:
        return unknown(f"stages.{stage}.out is not configured", clock=clock)
    try:
        summary = summarize(out_dir)
        owner = summary.get("run")
        if run and owner and owner != run:
            return unknown(f"{out_dir}/manifest.sqlite is run {owner}'s: this run's {stage} has not taken it over "
                           "yet", clock=clock)
        return known(with_latency_profile(summary), clock=clock)
    except FileNotFoundError as exc:
        return unknown(str(exc), clock=clock)
    except (OSError, sqlite3.Error) as exc:
        return unknown(f"{out_dir}/manifest.sqlite unreadable: {exc}", clock=clock)


def with_latency_profile(summary: dict) -> dict:
    """The manifest's summary as an observation carries it: its raw latency sums as `latency_moments` (the
    profile's JSON, pipeline/observe/latency.py), None before latencies were kept."""
    out = dict(summary)
    profile = LatencyProfile.from_bins(out.pop("latency_bins", None))
    out["latency_moments"] = profile.to_json() if profile is not None and profile.samples else None
    return out


OWN_FIELDS = {"step": "step", "total": "total_steps", "loss": "loss"}  # this trainer's progress.jsonl


def read_train_progress(ckpt_dir: Path | None, *, clock=time.time, run: str | None = None) -> Reading:
    """Training progress from the last line of CKPT_DIR/progress.jsonl (this project's trainer); unknown while that
    line is another run's (each line names its run): a new training's first ticks, before the trainer moved the
    earlier training aside, never read the earlier one's steps."""
    if ckpt_dir is None:
        return unknown("stages.train.out is not configured", clock=clock)
    return read_jsonl_progress(Path(ckpt_dir) / "progress.jsonl", clock=clock,
                               validation=Path(ckpt_dir) / "validation.jsonl", run=run)


def read_jsonl_progress(path: Path, fields: dict[str, str] | None = None, *, clock=time.time,
                        validation: Path | None = None, run: str | None = None) -> Reading:
    """Progress from the last whole line of a JSON-lines log that carries a step: `fields` maps step, total and
    loss to the tool's names (this trainer's by default). A torn or foreign line is passed over."""
    names = {**OWN_FIELDS, **(fields or {})}
    for line in reversed(tail_lines(path, 20)):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        step = rec.get(names["step"]) if isinstance(rec, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) or isinstance(step, float) and step.is_integer():
            if run and rec.get("run") and rec["run"] != run:
                return unknown(f"{path} is run {rec['run']}'s: this run's training has not logged a step yet",
                               clock=clock)
            total, loss = rec.get(names["total"]), rec.get(names["loss"])
            value = {"done": int(step), "failed": 0,
                     "total": int(total) if isinstance(total, (int, float)) and total > 0 else None, "unit": "steps",
                     "loss": float(loss) if isinstance(loss, (int, float)) else None, "kl": rec.get("kl"),
                     "tokens_per_s": rec.get("tokens_per_s"), "lr": rec.get("lr"), "error": rec.get("error"),
                     # what the trainer's kept checkpoints and draft will still add (this trainer's own field)
                     "disk_need_bytes": rec.get("disk_need_bytes")}
            if validation is not None:
                value.update(_last_validation(validation))
            return known(value, clock=clock)
    return unknown(f"{path}: no line with a {names['step']!r} step logged yet", clock=clock)


TAU_FLAT = 0.02  # a validation's τ within this of the best before it is "not rising"
TAU_FLAT_AFTER = 2  # validations in a row without a rise before it is said


def _last_validation(path: Path) -> dict:
    """The trainer's validations: the last one's top-1 accuracy of each unrolled step (draft depth) and its step;
    the simulated acceptance length τ = 1 + Σₖ Πⱼ≤ₖ accⱼ at it and at the validation before; and, when the last
    TAU_FLAT_AFTER validations did not raise τ by TAU_FLAT over the best before them, the step of that best
    (`tau_flat_since`): loss and accuracy alone do not say when to stop."""
    runs = []
    for line in tail_lines(path, 50):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        acc = rec.get("acc") if isinstance(rec, dict) else None
        if isinstance(acc, list) and all(a is None or isinstance(a, (int, float)) for a in acc):
            runs.append((rec.get("step"), acc, 1.0 + accepted_length(acc)))
    if not runs:
        return {}
    step, acc, tau = runs[-1]
    out = {"acc_by_depth": acc, "validated_at_step": step, "tau": round(tau, 3), "tau_step": step}
    if len(runs) > 1:
        out.update(tau_prev=round(runs[-2][2], 3), tau_prev_step=runs[-2][0])
    if len(runs) > TAU_FLAT_AFTER:
        best_step, _, best = max(runs[:-TAU_FLAT_AFTER], key=lambda r: r[2])
        if all(r[2] < best + TAU_FLAT for r in runs[-TAU_FLAT_AFTER:]):
            out["tau_flat_since"] = best_step
    return out


READ_PER_CALL = 8 << 20  # a log tail reads at most this much a call; a long log is caught up over calls


class LogProgress:
    """Tails a stage log from its last offset; a regex with groups `done` and `total` gives progress."""

    def __init__(self, path: Path, pattern: str, *, clock=time.time) -> None:
        self.path, self.regex, self.clock = Path(path), re.compile(pattern), clock
        self.offset = 0
        self.inode: int | None = None
        self.last: dict | None = None
        self.behind = False  # the last read stopped at READ_PER_CALL with more of the log to read

    def read(self) -> Reading:
        """The last matching line's done/total (at most READ_PER_CALL of new log a call)."""
        try:
            st = os.stat(self.path)
            if st.st_ino != self.inode or st.st_size < self.offset:  # rotated or truncated
                self.inode, self.offset = st.st_ino, 0
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(READ_PER_CALL)
            self.behind = self.offset + len(data) < st.st_size
        except OSError as exc:
            return unknown(f"{self.path}: {exc.strerror}", clock=self.clock)
        cut = data.rfind(b"\n") + 1  # only whole lines
        self.offset += cut
        for line in data[:cut].decode("utf-8", "replace").splitlines():
            m = self.regex.search(line)
            if m:
                self.last = {"done": int(m.group("done")), "failed": 0,
                             "total": int(m.group("total")) if "total" in m.groupdict() and m.group("total") else None,
                             "unit": "lines"}
        return known(self.last, clock=self.clock) if self.last else unknown(
            f"{self.path}: no line matched the progress regex yet", clock=self.clock)
