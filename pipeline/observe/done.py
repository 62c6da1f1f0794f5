"""What "done" means for a stage that exited 0 (`done_when`), and each stage's progress source.

A stage run by another tool (SpecForge's trainer, SpecForge's or speculators' data generation) exits
0 when *it* thinks it is finished. That is the seed's blind spot: exit 0 is not done. Whatever the
rule, a stage that exited 0 is done only if its progress agrees (an exit at 900 of 1,000 is an early
exit, not done); `done_when` adds:
- `exit0` — nothing more (this project's own stages, whose progress carries their totals);
- `exit0-and-total` — the last step must equal a known total: without a total it is not done;
- `file:GLOB` — a file matching GLOB (relative to the stage's cwd) must exist, e.g. the exported
  draft's `model.safetensors`.

The sampler records the rule and what it found in the observation (`done_when`), so the verdict is a
function of the observation history (the replay contract), and the handoff asks the same question
through `finished()`.
"""

from __future__ import annotations

import glob
import time
from pathlib import Path

from pipeline.config import (
    FilesSettings,
    JsonlFields,
    LogRegexSettings,
    TensorboardSettings,
    Workspace,
)
from pipeline.layout import parts_dir
from pipeline.observe.probes import Reading, known, unknown
from pipeline.observe.probes.progress import (
    LogProgress,
    read_jsonl_progress,
    read_manifest,
    read_train_progress,
)
from pipeline.observe.probes.tensorboard import TensorboardProgress
from pipeline.verdict import num


def source_of(ws: Workspace, stage: str) -> str:
    """The stage's progress source, `auto` resolved."""
    declared = ws.stage(stage).progress.kind
    if declared != "auto":
        return declared
    return {"extract": "manifest", "regenerate": "manifest", "train": "progress-jsonl"}.get(stage, "none")


def progress_call(ws: Workspace, stage: str, files: dict | None, *, clock=time.time, readers: dict | None = None,
                  run: str | None = None):
    """A no-argument callable that reads the stage's progress (a Reading), or None where it has none. `readers`
    keeps the incremental ones (a log tail, event files) between calls. With `run`, a manifest or this trainer's
    progress.jsonl that another run wrote reads as unknown."""
    source, cfg = source_of(ws, stage), ws.stage(stage)
    settings = cfg.progress  # the source's own settings (pipeline/config.py: one model a source)
    readers = {} if readers is None else readers
    if source == "manifest":
        out = ws.resolve(getattr(cfg, "out", None))
        where = parts_dir(out) if stage == "regenerate" and out is not None else out
        return lambda: read_manifest(where, clock=clock, stage=stage, run=run)
    if isinstance(settings, JsonlFields) and (settings.progress_file or settings.progress_fields):
        path = ws.resolve(settings.progress_file) or ((ws.out_dir(stage) or ws.root) / "progress.jsonl")
        fields = settings.progress_fields
        return lambda: read_jsonl_progress(path, fields, clock=clock)
    if source == "progress-jsonl":
        return lambda: read_train_progress(ws.resolve(getattr(cfg, "out", None)), clock=clock, run=run)
    if isinstance(settings, TensorboardSettings):
        if stage not in readers:
            readers[stage] = TensorboardProgress(ws.resolve(settings.progress_dir), tag=settings.progress_tag or "",
                                                 total=settings.progress_total, total_tag=settings.progress_total_tag,
                                                 loss_tag=settings.loss_tag, clock=clock)
        return readers[stage].read
    if isinstance(settings, LogRegexSettings) and settings.progress_regex:
        if stage not in readers:
            readers[stage] = LogProgress(ws.log_path(stage), settings.progress_regex, clock=clock)
        return readers[stage].read
    if isinstance(settings, FilesSettings):
        total = settings.files_total
        return lambda: files_progress(files, total, clock)
    return None


def files_progress(files: dict | None, total: int | None, clock) -> Reading:
    if not files:
        return unknown("file count unknown this tick", clock=clock)
    return known({"done": files["count"], "failed": 0, "total": total, "unit": "files"}, clock=clock)


def matched_file(ws: Workspace, stage: str) -> str | None:
    """The first file matching the stage's `done_when = "file:GLOB"` (relative to its cwd), or None."""
    rule = ws.stage(stage).done_when
    if not rule.startswith("file:"):
        return None
    pattern = rule[5:].strip()
    base = ws.resolve(ws.stage(stage).cwd) or ws.root
    hits = sorted(glob.glob(pattern if Path(pattern).is_absolute() else str(base / pattern), recursive=True))
    return hits[0] if hits else None


def evidence(ws: Workspace, stage: str) -> dict:
    """What an observation records of the rule once the stage has ended: {"rule", "file"}."""
    rule = ws.stage(stage).done_when
    return {"rule": rule, "file": matched_file(ws, stage) if rule.startswith("file:") else None}


def not_done(rule: dict | None, prog: dict | None) -> str | None:
    """Why a stage that exited 0 is not done by its `done_when` rule beyond progress (None: it is)."""
    if not rule or rule.get("rule", "exit0") == "exit0":
        return None
    prog = prog or {}
    if rule["rule"] == "exit0-and-total":
        done, total = num(prog, "done"), num(prog, "total")
        if done is None or not total:
            return ("exited 0, but its total is unknown and done_when = \"exit0-and-total\" needs the last step to "
                    "reach it (set progress_total, or the tool's total field)")
        if done < total:
            return f"exited 0 at step {int(done):,} of {int(total):,} (done_when = \"exit0-and-total\")"
        return None
    if rule["rule"].startswith("file:") and not rule.get("file"):
        return f"exited 0, but no file matches {rule['rule'][5:]!r} (done_when)"
    return None


CATCH_UP_READS = 120  # an incremental reader reads a bounded amount a call (event files 64 MiB / 0.5 s, a log 8 MiB)


def finished(ws: Workspace, stage: str, *, clock=time.time) -> str | None:
    """For the handoff, once `stage` exited 0: why it is not done (None: it is). Progress read afresh, to the end
    of the stage's files (an incremental reader — event files, a log tail — catches up over several reads)."""
    rule = evidence(ws, stage)
    if rule["rule"] == "exit0":
        return None
    readers: dict = {}
    call = progress_call(ws, stage, None, clock=clock, readers=readers)
    reading = call() if call else None
    reader = readers.get(stage)
    for _ in range(CATCH_UP_READS):
        if not getattr(reader, "behind", False):
            break
        reading = call()
    prog = reading.value if reading is not None and not reading.unknown else None
    return not_done(rule, prog)
