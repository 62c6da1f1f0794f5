"""Other tools' stages (issue 37): stand-ins that write TensorBoard events, a JSON log with other field names,
and one file per sample, as the real tools do, under the real monitor — progress, loss, a stall when the writer
stops, `done_when`, completion, `status --json` and the Slack view."""

from __future__ import annotations

import json
import threading

import pytest

from tests.conftest import fixture_argv, status_json, wait_for

pytestmark = pytest.mark.timeout(150)

STEPS = 40
SOURCES = {
    "tensorboard": ("train", 'progress = "tensorboard"\nprogress_dir = "out/runs"\nprogress_tag = "train/loss"\n'
                             f'progress_total = {STEPS}\nloss_tag = "train/loss"\n'),
    "jsonl": ("train", 'progress = "progress-jsonl"\nprogress_file = "out/trainer_log.jsonl"\n'
                       'progress_fields = { step = "global_step", total = "max_steps", loss = "train_loss" }\n'),
    "files": ("extract", f'progress = "files"\nfiles_dir = "out/rows"\nfiles_suffix = ".ckpt"\nfiles_total = {STEPS}\n'),
}


def workspace(tmp_path, fmt: str, *args: str, done_when: str = "exit0"):
    from pipeline.config import load_workspace

    stage, source = SOURCES[fmt]
    argv = fixture_argv("foreign_tool.py", fmt, "out", str(STEPS), "0.15", *args)
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(f"[monitor]\ntick_s = 0.3\nfake_gpus = 2\nstall_floor_s = 3\n\n[stages.{stage}]\n"
                   f"argv = {json.dumps(argv)}\nout = \"out\"\ndone_when = {json.dumps(done_when)}\n{source}")
    return cfg, load_workspace(cfg), stage


def monitored(ws, stage: str, until, *, what: str, timeout: float = 60, inspect=None):
    """Start `stage`, run the monitor in this process until `until(stage status)` holds; returns (that run
    status, every stage status seen, what `inspect(controller)` returned then, before anything is stopped)."""
    from pipeline.controller import Controller
    from pipeline.monitor import Monitor

    ctl = Controller(workspace=ws)
    monitor = Monitor(ws=ws)
    thread = threading.Thread(target=monitor.run, daemon=True)
    seen = []
    try:
        ctl.start(stage, force=stage == "train")
        thread.start()

        def check():
            st = ctl.status(sample_if_unmonitored=False)
            seen.append(st.stages[stage])
            return until(st.stages[stage]) and st

        st = wait_for(check, timeout=timeout, interval=0.3, what=what)
        return st, seen, inspect(ctl) if inspect else None
    finally:
        monitor.stop()
        thread.join(timeout=30)
        ctl.stop_all(grace_s=2)
        ctl.close()


@pytest.mark.parametrize("fmt", list(SOURCES))
def test_progress_loss_and_a_stall_when_the_writer_stops(tmp_path, fmt):
    from handlers.render.blocks import blocks_text, status_blocks

    cfg, ws, stage = workspace(tmp_path, fmt, "--stop-at", "12")
    st, seen, js = monitored(ws, stage, lambda s: s.verdict == "stalled", what=f"{fmt}: stalled after the writer stops",
                             inspect=lambda _ctl: status_json(cfg)["stages"][stage])
    moving = [s for s in seen if s.verdict in ("progressing", "slow", "starting") and s.done]
    assert moving and all(0 < s.progress_pct < 100 for s in moving if s.progress_pct is not None)
    stalled = st.stages[stage]
    assert stalled.done == 12 and stalled.total == STEPS and stalled.progress_pct == pytest.approx(30.0)
    assert any("no progress for" in r for r in stalled.reasons), stalled.reasons
    if fmt != "files":
        assert stalled.progress["loss"] == pytest.approx(5.0 / 12, rel=1e-5) and stalled.progress["unit"] == "steps"
    assert js["verdict"] == "stalled" and js["done"] == 12 and js["total"] == STEPS
    text = blocks_text(status_blocks(st, version="v")[1])
    assert "stalled" in text and "30" in text, text


@pytest.mark.parametrize(("fmt", "args", "done_when", "verdict", "reason"), [
    ("tensorboard", ("--exit-at", "30"), "exit0-and-total", "dead",
     'exited 0 at step 30 of 40 (done_when = "exit0-and-total")'),
    ("jsonl", (), "file:out/draft/*.safetensors", "dead",
     "exited 0, but no file matches 'out/draft/*.safetensors' (done_when)"),
    ("jsonl", ("--export",), "file:out/draft/*.safetensors", "done", "exited 0 with 40 / 40 done"),
    ("files", (), "exit0", "done", "exited 0 with 40 / 40 done"),
], ids=["tensorboard-early", "jsonl-no-file", "jsonl-file", "files"])
def test_done_when_and_completion(tmp_path, fmt, args, done_when, verdict, reason):
    from pipeline.handoff import completion
    from pipeline.observe.done import finished

    cfg, ws, stage = workspace(tmp_path, fmt, *args, done_when=done_when)
    # another tool's extraction is complete by the monitor's final verdict, its total known; the handoff asks
    # `finished` of a training that exited 0
    st, _, (c, why) = monitored(ws, stage, lambda s: s.verdict in ("done", "dead"), what=f"{fmt}: its end judged",
                                inspect=lambda ctl: (completion.check(ws, ctl.store), finished(ws, stage)))
    end = st.stages[stage]
    assert (end.verdict, end.reasons[0]) == (verdict, reason), end.reasons
    assert why == (None if verdict == "done" else reason)
    if stage == "extract":
        assert c.complete and (c.done, c.total) == (STEPS, STEPS), c.missing
