"""Operating it for real (issue 30): training stopped, started again, crashed and relaunched resumes at
its saved step within its run; the next run's training sets the last one's aside, as --fresh does. The
real trainer under the real runner (one process: the real torchrun pair is test_train's)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from pipeline.automation import Automation
from pipeline.config import load_workspace
from pipeline.store import Store
from tests.conftest import eagle3, status_json, toml_list, wait_for

pytestmark = pytest.mark.timeout(240)
SMALL = ["--token-budget", "1024", "--ttt", "3", "--lr", "1e-2"]


def steps(ckpt: Path) -> list[int]:
    path = ckpt / "progress.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def saved_step(ckpt: Path) -> int | None:
    try:
        return int((ckpt / "latest").read_text().strip().removeprefix("step_"))
    except OSError:
        return None


def log_text(cfg: Path) -> str:
    path = cfg.parent / ".eagle3" / "logs" / "train.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture
def train_ws(tmp_path, toy_extraction):
    argv = [sys.executable, "-m", "pipeline.train", "--data", str(toy_extraction["out"]), "--target-model",
            str(toy_extraction["target"]), "--out", "ckpt", "--steps", "5000", *SMALL, "--save-every", "2"]
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(f'[stages.train]\nargv = {toml_list(argv)}\nout = "ckpt"\nrestart = "on-failure"\n'
                   "restart_backoff_s = 0\nmax_restarts = 2\n")
    yield cfg
    eagle3("stop", "--all", "--grace", "5", "--config", str(cfg))


@pytest.mark.slow
def test_stop_start_crash_and_relaunch_resume_training_and_another_runs_is_set_aside(train_ws):
    cfg, ckpt = train_ws, train_ws.parent / "ckpt"
    started = eagle3("start", "train", "--force", "--config", str(cfg))
    assert started.returncode == 0, started.stderr
    run = status_json(cfg)["run"]
    wait_for(lambda: (saved_step(ckpt) or 0) >= 4, timeout=120, interval=0.2, what="a checkpoint at step 4")

    # stop, then start: the SIGTERM checkpoint is where the next start continues, in the same run
    stopped = eagle3("stop", "train", "--grace", "60", "--config", str(cfg))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    first = saved_step(ckpt)
    assert "checkpoint saved at step" in log_text(cfg)
    assert status_json(cfg)["run"] == run, "a stopped training keeps its run open"
    assert eagle3("start", "train", "--force", "--config", str(cfg)).returncode == 0
    wait_for(lambda: f"resumed from step {first}" in log_text(cfg), timeout=120, interval=0.2, what="the resume")
    wait_for(lambda: (saved_step(ckpt) or 0) >= first + 2, timeout=120, interval=0.2, what="a later checkpoint")

    # a crash (kill -9 of the trainer): the restart policy relaunches it, and the relaunch resumes too
    ws = load_workspace(cfg)
    store = Store(ws.store_path)
    try:
        proc = store.latest_proc("train")
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: store.proc(proc.id).state == "exited", timeout=30, what="the runner to record it")
        crashed_at = saved_step(ckpt)
        Automation(ws=ws, store=store).restart_policy()
        relaunched = store.latest_proc("train")
        assert relaunched.id != proc.id and relaunched.run_id == run
    finally:
        store.close()
    wait_for(lambda: f"resumed from step {crashed_at}" in log_text(cfg), timeout=120, interval=0.2,
             what="the relaunch to resume")
    wait_for(lambda: len(steps(ckpt)) >= crashed_at + 2, timeout=120, interval=0.2, what="steps after the relaunch")
    assert eagle3("stop", "train", "--grace", "60", "--config", str(cfg)).returncode == 0
    done = steps(ckpt)
    assert done == list(range(1, len(done) + 1)), "no step repeated or skipped across stop, start and the crash"
    kept = sorted(int(p.name.removeprefix("step_")) for p in (ckpt / "checkpoints").iterdir())
    assert len(kept) <= 3 and kept[-1] == saved_step(ckpt), f"--keep-last 3 (the default) bounds them: {kept}"
    assert "deleted" in log_text(cfg) and "--keep-last 3" in log_text(cfg)
    lines = [json.loads(line) for line in (ckpt / "progress.jsonl").read_text().splitlines()]
    assert lines[0].get("disk_need_bytes") is None and isinstance(lines[-1]["disk_need_bytes"], int), \
        "from the first save on, each line says what the kept checkpoints and the draft will still need"
    assert {r["run"] for r in lines} == {run}, "each progress line names its run"

    # the next run (stop --all closed this one): this run's checkpoint is another run's, so the trainer
    # moves it whole to OUT/previous/<time>/ and starts at step 1 — never resuming another run's training
    assert eagle3("stop", "--all", "--grace", "60", "--config", str(cfg)).returncode == 0
    old_umask = os.umask(0o022)
    try:
        assert eagle3("start", "train", "--force", "--config", str(cfg)).returncode == 0
    finally:
        os.umask(old_umask)
    assert status_json(cfg)["run"] != run
    wait_for(lambda: f"belongs to run {run}, not to this run" in log_text(cfg), timeout=120, interval=0.2,
             what="the new run's trainer to set the last run's training aside")
    wait_for(lambda: (saved_step(ckpt) or 0) >= 2, timeout=120, interval=0.2, what="a checkpoint at step 2 of the new run")
    assert steps(ckpt)[:2] == [1, 2]
    (aside,) = (ckpt / "previous").iterdir()
    assert steps(aside) == done and saved_step(aside) is not None
    assert [p.name for p in (aside / "checkpoints").iterdir()] == [f"step_{saved_step(aside)}"], \
        "an earlier training keeps its last checkpoint (it was never validated: no best besides)"
    # files another user must read honour the umask (safetensors alone would make them 0600)
    model = ckpt / "checkpoints" / "step_2" / "model.safetensors"
    assert model.stat().st_mode & 0o777 == 0o644


def test_start_train_fresh_moves_the_earlier_training_aside(tmp_path):
    """`eagle3 start train --fresh`: the controller moves OUT's training files aside before the start
    (a stand-in trainer: the real one's resume is the test above)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "checkpoints" / "step_4").mkdir(parents=True)
    (ckpt / "latest").write_text("step_4\n")
    (ckpt / "progress.jsonl").write_text('{"step": 1}\n')
    (ckpt / "keep.txt").write_text("not the trainer's")
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(f'[stages.train]\nargv = {toml_list([sys.executable, "-c", "pass"])}\nout = "ckpt"\n')
    refused = eagle3("start", "extract", "--fresh", "--config", str(cfg))
    assert refused.returncode == 2 and "--fresh is for training" in refused.stderr
    fresh = eagle3("start", "train", "--fresh", "--force", "--config", str(cfg))
    assert fresh.returncode == 0, fresh.stderr
    (aside,) = (ckpt / "previous").iterdir()
    assert f"moved the earlier training's files to {aside}" in fresh.stdout
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "latest", "progress.jsonl"]
    assert (ckpt / "keep.txt").exists() and not (ckpt / "latest").exists()
