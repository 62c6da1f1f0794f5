"""Verified completion of extraction: the only gate to training.

Only the current run counts: an extraction (and its manifest) left by an earlier run in the
same workspace is another run's data, never this run's completion. Complete means: this run's
extraction stage exited 0, the manifest's processed == total,
the failed share is within the maximum, no temp files are left, and `verify`
passes on a random sample of files. Anything less is not complete, and the answer
says which condition is missing, with the manifest's numbers.

Another tool's extraction (`progress` other than manifest: SpecForge's or speculators' data
generation, one file per sample) has no manifest to verify: it is complete when the monitor
observed its end and judged it done — exit 0, progress at a known total, its `done_when` met.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import Workspace
from pipeline.manifest import summarize
from pipeline.observe.done import source_of
from pipeline.states import MAYBE_ALIVE_STATES, StageProc, StageState
from pipeline.store import Store


@dataclass
class Completion:
    """Whether extraction is verified complete, and why not."""

    complete: bool
    missing: list[str] = field(default_factory=list)
    done: int | None = None
    failed: int | None = None
    total: int | None = None
    eta_s: float | None = None
    server_running: bool = False  # this run's server is (maybe) alive: it still holds its GPUs
    run: str | None = None
    autostart_armed: bool = False  # the train-now guard's caller fills it: auto-start already waits for this

    @property
    def pct(self) -> float:
        """Processed share in percent (0 before the first sample)."""
        if not self.total:
            return 0.0
        return 100.0 * ((self.done or 0) + (self.failed or 0)) / self.total


def check(ws: Workspace, store: Store, *, verify_sample: int = 200, run_verify: bool = True,
          run: str | None = None) -> Completion:
    """Evaluate every condition for the open run (or `run`, a closed one); with `run_verify` the slow ones
    (listing the tree, opening sample files) run too, once the cheap ones hold. Without it only the store and
    the manifest are read."""
    run = run or store.current_run()
    proc = store.latest_proc("extract", run=run) if run else None
    server = store.latest_proc("server", run=run) if run else None
    c = Completion(complete=False, run=run,
                   server_running=server is not None and server.state in MAYBE_ALIVE_STATES)
    if proc is None:  # the manifest on disk, if any, is an earlier run's: not this run's progress
        regen = store.latest_proc("regenerate", run=run) if run else None
        if regen is not None and regen.maybe_alive:
            v = store.verdict("regenerate")
            count = (f" ({int(v.done + (v.failed or 0)):,} / {int(v.total):,} conversations)"
                     if v is not None and v.proc_id == regen.id and v.done is not None and v.total else "")
            c.missing.append(f"waiting for regeneration{count}: extraction follows it, by itself when auto-start "
                             "is armed")
            return c
        c.missing.append("extraction has not run in this run" if run else
                         "no run is open (extraction has not run since the last run closed)")
        return c
    ws = ws.for_run(run)  # `{run}` in the paths: this run's own place
    if source_of(ws, "extract") != "manifest":
        return _by_final_verdict(c, store, proc)
    out = ws.out_dir("extract")
    prog, unreadable = {}, None
    if out is None:
        unreadable = "stages.extract.out is not configured"
    else:
        try:
            prog = summarize(out)
        except FileNotFoundError as exc:
            unreadable = str(exc)
        except (OSError, sqlite3.Error) as exc:
            unreadable = f"{out}/manifest.sqlite: {exc}"
    verdict = store.verdict("extract")
    c.done, c.failed, c.total = prog.get("done"), prog.get("failed"), prog.get("total")
    c.eta_s = verdict.eta_s if verdict and verdict.proc_id == proc.id else None
    if proc.state == StageState.RUNNING:
        c.missing.append("extraction is still running")
    elif proc.state != StageState.EXITED or proc.exit_code != 0:
        how = proc.reason or proc.state
        c.missing.append(f"the last extraction run did not exit 0 ({how})")
    if unreadable:
        c.missing.append(f"manifest unreadable: {unreadable}")
    elif c.total is None or c.done is None:
        c.missing.append("the manifest has no totals yet")
    else:
        processed = c.done + (c.failed or 0)
        if processed < c.total:
            c.missing.append(f"{processed:,} of {c.total:,} samples processed")
        share = (c.failed or 0) / c.total if c.total else 0.0
        if share > ws.config.handoff.max_failed_share:
            c.missing.append(f"{share * 100:.2g} % of samples failed, above the "
                             f"{ws.config.handoff.max_failed_share * 100:.2g} % maximum")
    # Listing the output tree and opening sample files are the slow checks (an `ls` of the
    # incident's 3.5 TB timed out): they run only when everything cheap already holds.
    if not c.missing and run_verify:
        temps = _temp_files(out)
        if temps:
            c.missing.append(f"{temps} temp file(s) left in {out}/hidden_states")
    if not c.missing and run_verify and out is not None:  # (no out is a missing condition above)
        from pipeline.extract.verify import verify

        res = verify(out, sample=verify_sample)
        if not res.ok or not res.checked:
            c.missing.append(f"verify found {len(res.problems)} problem(s): {'; '.join(res.problems[:3])}")
    c.complete = not c.missing
    return c


def _by_final_verdict(c: Completion, store: Store, proc: StageProc) -> Completion:
    """Another tool's extraction (progress from its files, its log or its JSON lines; no manifest to verify):
    complete when the monitor observed its end and judged it done — exit 0, its progress at its total, the
    failed share within the maximum, its done_when met — and the total is known."""
    seen = store.verdict("extract")
    verdict = seen if seen is not None and seen.proc_id == proc.id else None  # this process's, or none
    if verdict is not None:
        c.done, c.failed, c.total, c.eta_s = verdict.done, verdict.failed, verdict.total, verdict.eta_s
    if proc.state == StageState.RUNNING:
        c.missing.append("extraction is still running")
    elif proc.state != StageState.EXITED or proc.exit_code != 0:
        c.missing.append(f"the last extraction run did not exit 0 ({proc.reason or proc.state})")
    elif verdict is None or not verdict.final:
        c.missing.append("the monitor has not yet observed this extraction's end")
    elif verdict.verdict != "done":
        c.missing.append(f"its end was judged {verdict.verdict}: {'; '.join(verdict.reasons)}")
    if c.total is None and not c.missing:
        c.missing.append("its progress has no total (set files_total, or a total in its progress source), so "
                         "completion cannot be verified")
    c.complete = not c.missing
    return c


def _temp_files(out: Path | None) -> int:
    if out is None or not (out / "hidden_states").is_dir():
        return 0
    return sum(1 for p in (out / "hidden_states").iterdir() if p.name.startswith("."))
