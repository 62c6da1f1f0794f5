"""A week in one workspace: five runs, played with real processes (the extraction client against the toy server
over HTTP, a stand-in trainer), the CLI's controller and the service's sampler, automation and notifier.

1. the guide's layout: a prepared chat file regenerated, extracted and trained by auto-start alone; the run
   closes when training finishes.
2. another chat file, the same commands and no edit of the config (`{run}` paths): each stage writes into the
   run's own directory; then `stop --all` and `start train` trains on run 2's verified extraction, reopening it.
3. the config changed between runs; the restarted service does not judge run 2's finished training again;
   a partly edited dataset; extraction stopped part-way and started again resumes in the same directory.
4. a dataset path that does not exist: extraction exits 2 and the restart policy gives up at once; a reminder is set.
5. the next run: run 4's reminder is not posted into it; its milestones are its own.

Throughout: no sample of another run's dataset is counted, no reading or message of another run is shown as
this run's, and a closed run's stages are labelled as such.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from pipeline.automation import Automation
from pipeline.config import load_workspace
from pipeline.controller import Controller
from pipeline.extract.writer import read_sample
from pipeline.observe.sampler import Sampler
from pipeline.toy.demo_workspace import write_dataset as write_chats
from tests.conftest import FIXTURES, eagle3, toml_list, wait_for
from tests.toy import ToyServer, write_dataset

pytestmark = pytest.mark.timeout(240)


def config(url: str, *, steps: int = 3, data: str = "data.jsonl", regenerate: bool = False) -> str:
    """The week's workspace: `{run}` in every output path, as deploy/eagle3.example.toml; with `regenerate`, the
    guide's layout (prepared.jsonl → regenerate → runs/{run}/train.jsonl → extract → train)."""
    regen = ""
    if regenerate:
        data = "runs/{run}/train.jsonl"
        argv = [sys.executable, "-m", "bot.cli", "regenerate", "--server", url, "--data", "prepared.jsonl", "--out",
                data, "--temperature", "0", "--max-new-tokens", "6", "--concurrency", "4"]
        regen = f'[stages.regenerate]\nargv = {toml_list(argv)}\ndata = "prepared.jsonl"\nout = "{data}"\n'
    extract = [sys.executable, "-m", "bot.cli", "extract", "--server", url, "--data", data, "--out",
               "runs/{run}/hidden", "--parse-workers", "0", "--concurrency", "2"]
    train = [sys.executable, str(FIXTURES / "fake_train.py"), "runs/{run}/ckpt", str(steps)]
    return (regen + f'[stages.extract]\nargv = {toml_list(extract)}\nout = "runs/{{run}}/hidden"\ndata = "{data}"\n'
            'restart = "on-failure"\nrestart_backoff_s = 0\n'
            f'[stages.train]\nargv = {toml_list(train)}\nout = "runs/{{run}}/ckpt"\n'
            '[handoff]\nverify_sample = 50\ngpu_release_timeout_s = 5\n[monitor]\nfake_gpus = 1\n')


def by_itself(ws, ctl: Controller) -> str:
    """The guide's second-run commands (`start regenerate`, `autostart on`) and then nothing but the service's
    automation ticks: regeneration, then extraction, then training, each started by itself. Returns the run."""
    ctl.start("regenerate")
    run = ctl.store.current_run()
    ctl.autostart(True, by="test")
    auto = Automation(ws=ws, store=ctl.store)

    def trained():
        auto.tick()
        ctl.supervisor.refresh()
        train = ctl.store.latest_proc("train", run=run)
        return train if train and train.has_ended else None
    assert wait_for(trained, timeout=120, interval=0.3, what="regenerate → extract → train by itself").exit_code == 0
    return run


def token_ids(out: Path) -> dict[int, list[int]]:
    """Each done sample's token ids, read from its file (the manifest's rows say which are done)."""
    conn = sqlite3.connect(out / "manifest.sqlite")
    done = [r[0] for r in conn.execute("SELECT idx FROM samples WHERE status = 'done'")]
    conn.close()
    return {i: read_sample(out / "hidden_states" / f"hs_{i}.safetensors")["token_ids"].array.tolist() for i in done}


def done_so_far(out: Path) -> int:
    """Samples done in a running extraction: 0 until its manifest and table exist."""
    try:
        return len(token_ids(out)) if (out / "manifest.sqlite").exists() else 0
    except sqlite3.OperationalError:  # created, its table not yet
        return 0


def ended(ctl: Controller, stage: str):
    def check():
        ctl.supervisor.refresh()
        proc = ctl.store.latest_proc(stage)
        return proc if proc and proc.has_ended else None
    return wait_for(check, timeout=90, interval=0.2, what=f"{stage} to end")


@pytest.fixture
def week(tmp_path):
    server = ToyServer("--latency-ms", "100")  # run 3's extraction lasts long enough to be stopped part-way
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(config(server.url, regenerate=True))
    yield server, cfg
    eagle3("stop", "--all", "--grace", "5", "--config", str(cfg))
    server.stop()


@pytest.mark.slow
def test_five_runs_in_one_workspace(week):
    server, cfg = week
    root = cfg.parent
    data = root / "data.jsonl"

    # --- run 1: the guide's layout — a prepared chat file regenerated, extracted and trained by auto-start alone;
    # training's end closes the run
    prepared = root / "prepared.jsonl"
    write_chats(prepared, 6, seed=41, turns=True)
    checked = eagle3("check-config", str(cfg))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    r1 = by_itself(ws, ctl)
    assert ctl.store.current_run() is None, "training finished: its run closed"
    regenerated1 = root / "runs" / r1 / "train.jsonl"
    a = [json.loads(line)["input_ids"] for line in regenerated1.read_text().splitlines()]
    out1 = root / "runs" / r1 / "hidden"
    assert len(a) == 6 and token_ids(out1) == dict(enumerate(a)), "run 1 extracted run 1's regeneration"
    ctl.close()

    # --- run 2: another chat file, the same commands, no edit of the config: regenerated into run 2's place
    write_chats(prepared, 8, seed=42, turns=True)
    ctl = Controller(workspace=ws)
    r2 = by_itself(ws, ctl)
    assert r2 != r1 and len([e for e in ctl.store.events(kind="chain") if e["run_id"] == r2]) == 1
    b = [json.loads(line)["input_ids"] for line in (root / "runs" / r2 / "train.jsonl").read_text().splitlines()]
    out2 = root / "runs" / r2 / "hidden"
    assert len(b) == 8 and token_ids(out2) == dict(enumerate(b)), "only run 2's data, in run 2's directory"
    assert token_ids(out1) == dict(enumerate(a)) and regenerated1.read_text().count("\n") == 6, "run 1's untouched"

    # stop --all (the run is closed already), then `start train`: it trains on run 2's verified extraction again,
    # reopening run 2 — no --force
    ctl.stop_all(grace_s=5)
    assert ctl.store.current_run() is None
    proc = ctl.start("train")
    assert proc.reopened == r2 and proc.run_id == r2
    assert ended(ctl, "train").exit_code == 0
    lines = (root / "runs" / r2 / "ckpt" / "progress.jsonl").read_text().splitlines()
    assert len(lines) == 6, "run 2's trainings wrote into run 2's directory"
    assert (root / "runs" / r1 / "ckpt" / "progress.jsonl").read_text().count("\n") == 3, "run 1's untouched"
    text = eagle3("status", "--config", str(cfg)).stdout
    assert f"(run {r2}, closed)" in text and f"out: {root / 'runs' / r2 / 'ckpt'}" in text
    ctl.close()

    # --- the service (its sampler) observes the end of run 2's training and judges it once
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    sampler = Sampler(ws=ws, store=ctl.store)
    try:
        sampler.tick()
    finally:
        sampler.close()
    assert ctl.store.verdict("train").verdict == "done" and ctl.store.verdict("train").run == r2
    judged = len(ctl.store.events(kind="verdict"))
    ctl.close()

    # --- run 3: the config changes between runs (another progress rule for train); a restarted service does not
    # judge run 2's training again; a partly edited dataset; extraction stopped part-way resumes in its run
    write_dataset(data, 8, seed=42)
    cfg.write_text(config(server.url, steps=4).replace('out = "runs/{run}/ckpt"\n',
                                                        'out = "runs/{run}/ckpt"\nprogress = "files"\n'
                                                        'done_when = "exit0-and-total"\n'))
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    sampler = Sampler(ws=ws, store=ctl.store)
    try:
        assert sampler.tick() == {}, "no stage running, and the finished ones judged already"
    finally:
        sampler.close()
    assert len(ctl.store.events(kind="verdict")) == judged and ctl.store.verdict("train").verdict == "done"
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({"id": "s2", "input_ids": [9, 8, 7, 6]})
    lines += [json.dumps({"id": f"x{i}", "input_ids": [5] * (30 + i)}) for i in range(40)]
    data.write_text("\n".join(lines) + "\n")
    c = [json.loads(line)["input_ids"] for line in lines]
    ctl.start("extract")
    r3 = ctl.store.current_run()
    out3 = root / "runs" / r3 / "hidden"
    wait_for(lambda: 0 < done_so_far(out3) < len(c), timeout=60, interval=0.1, what="part of run 3's extraction")
    ctl.stop("extract", grace_s=30)
    part = len(token_ids(out3))
    assert ctl.store.current_run() == r3, "stopping a stage keeps its run open"
    ctl.start("extract")
    assert ended(ctl, "extract").exit_code == 0
    assert any(f"resuming: {part} of {len(c)} samples already done" in line
               for line in ctl.logs("extract", lines=400)[1]), "the second start resumed in run 3's directory"
    assert token_ids(out3) == dict(enumerate(c))
    ctl.stop_all(grace_s=5)
    ctl.close()

    # --- run 4: a dataset that does not exist: exit 2, never restarted; a reminder set in this run
    cfg.write_text(config(server.url, data="missing.jsonl"))
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    ctl.start("extract")
    r4 = ctl.store.current_run()
    assert ended(ctl, "extract").exit_code == 2
    auto = Automation(ws=ws, store=ctl.store)
    auto.restart_policy()
    auto.restart_policy()
    assert len([p for p in ctl.store.procs("extract") if p.run_id == r4]) == 1, "exit 2 is final"
    (given_up,) = [e for e in ctl.store.events(kind="restart-limit") if e["run_id"] == r4]
    assert "no restart fixes" in given_up["data"]["reason"]
    ctl.remind("1s", by="cli:test")
    ctl.stop_all(grace_s=5)
    ctl.close()

    # --- run 5: the next run; run 4's reminder is not posted into it
    cfg.write_text(config(server.url))
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    write_dataset(data, 3, seed=45)
    ctl.start("extract")
    r5 = ctl.store.current_run()
    auto = Automation(ws=ws, store=ctl.store, clock=lambda: ctl.store.clock() + 5)
    auto.reminders()
    assert not [e for e in ctl.store.events(kind="reminder") if e["run_id"] == r5]
    (dropped,) = ctl.store.events(kind="reminder-dropped")
    assert dropped["run_id"] == r4
    assert ended(ctl, "extract").exit_code == 0
    status = ctl.status()
    assert status.run == r5 and status.stages["extract"].run == r5 and status.stages["extract"].progress_pct == 100.0
    assert status.stages["train"].run == r2, "the last training is run 2's, and shown as such"
    assert len({r1, r2, r3, r4, r5}) == 5
    assert sorted(p.name for p in (root / "runs").iterdir()) == sorted([r1, r2, r3, r5]), \
        "each run that wrote has its own directory; run 4 wrote nothing"
    ctl.close()
