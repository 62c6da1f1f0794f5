"""Messages that must not contradict the facts (issue 30, item 8–9): each reads the store as a status
post, the CLI or a slash answer would, and states what is known."""

from __future__ import annotations

import json

import pytest

from handlers.render.blocks import ACTION_AUTOSTART, status_blocks
from handlers.render.views import status_text, train_guard_text
from handlers.slash import answer
from pipeline.handoff import completion
from pipeline.verdict import StoredVerdict

pytestmark = pytest.mark.timeout(30)


# the config of the `ctl` fixture's controller (tests/conftest.py)
CONFIG = ("[stages.server]\nargv = [\"x\"]\n[stages.regenerate]\nargv = [\"r\"]\nout = \"regenerated.jsonl\"\n"
          "[stages.extract]\nargv = [\"y\"]\n[stages.train]\nargv = [\"z\"]\n")


def add(ctl, stage: str, **row) -> int:
    base = {"run_id": ctl.store.current_run() or ctl.store.open_run(), "stage": stage, "state": "running",
            "pid": 7, "argv": "[]", "started_at": 1.0, "stop_requested": 0}
    return ctl.store.insert_proc({**base, **row})


def actions(blocks: list) -> list[str]:
    return [e["action_id"] for b in blocks if b["type"] == "actions" for e in b["elements"]]


def test_a_just_started_stage_is_starting_not_unknown(ctl):
    add(ctl, "server")
    st = ctl.status(sample_if_unmonitored=False).stages["server"]
    assert st.verdict == "starting" and st.reasons == ("just started; not observed yet",)
    text, _ = status_blocks(ctl.status(sample_if_unmonitored=False), version="v")
    assert "Unknown" not in text and text.startswith("server: starting")


def test_a_training_that_ended_is_not_shown_progressing_and_offers_no_auto_start(ctl):
    proc = add(ctl, "train", state="exited", exit_code=0, ended_at=9.0, reason="exit code 0")
    ctl.store.put_verdict("train", StoredVerdict.from_json({"proc_id": proc, "verdict": "progressing", "progress_pct": 98.3, "eta_s": 5.0,
                                    "reasons": ["progress 2 s ago"], "t": 8.0, "final": False}))
    ctl.store.close_run(ctl.store.current_run(), reason="training finished (exit 0)")
    status = ctl.status(sample_if_unmonitored=False)
    st = status.stages["train"]
    assert st.verdict == "unknown" and st.eta_s is None
    assert st.reasons == ("ended (exit code 0); its verdict comes with the next observation",)
    text, blocks = status_blocks(status, version=ctl.state_version())
    assert "progressing" not in text
    assert ACTION_AUTOSTART not in actions(blocks), "no run open: nothing for auto-start to act on"
    assert status.autostart == "off" and "auto-start" not in status_text(status)


def test_gpus_says_why_there_is_no_reading(ctl):
    text, _ = answer(ctl, "gpus", [], user="U1")
    assert "no stage has been started" in text
    proc = add(ctl, "extract")
    ctl.store.put_verdict("extract", StoredVerdict.from_json({"proc_id": proc, "verdict": "progressing", "reasons": [], "t": 2.0}))
    ctl.store.add_observation({"t": 2.0, "stage": "extract", "gpus": None,
                               "unknown": {"gpus": "NVML not available: driver not loaded"}}, run_id=None)
    text, _ = answer(ctl, "gpus", [], user="U1")
    assert text == "GPUs: no reading (NVML not available: driver not loaded)"


def test_the_train_refusal_names_the_server_only_while_it_runs():
    c = completion.Completion(complete=False, missing=["40 of 100 samples processed"], done=40, failed=0, total=100,
                              run="r1", server_running=False)
    assert "holds the GPUs" not in train_guard_text(c) and "train on 40 % of the data" in train_guard_text(c)
    c.server_running = True
    assert "while the server holds the GPUs" in train_guard_text(c)


def test_undelivered_messages_are_counted_without_contradiction(ctl):
    ctl.store.enqueue(channel="C1", kind="k", text="t")
    ctl.store.db["outbox"].update(1, {"last_error": "not_in_channel"})
    text = status_text(ctl.status(sample_if_unmonitored=False))
    assert "slack: 1 message(s) waiting to be delivered (last error: not_in_channel" in text
    assert "refused" not in text.split("last error")[0]
    assert json.loads(json.dumps(ctl.status(sample_if_unmonitored=False).to_json()))["outbox"]["pending"] == 1


def test_a_failed_demo_training_names_the_failing_ranks_last_line(ctl):
    from bot.demo import _last_line

    log = ctl.ws.log_path("train")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("train: 154 train / 6 validation samples\n[rank1]: train: rank 1 needs cuda:1 but 1 GPU(s) are "
                   "visible\nE1204 torch.distributed.elastic: failed (exitcode: 2)\ntorch.distributed.elastic.multiprocessing."
                   "errors.ChildFailedError:\n\n")
    assert _last_line(ctl) == "[rank1]: train: rank 1 needs cuda:1 but 1 GPU(s) are visible"


def test_a_closed_runs_stage_is_labelled_and_the_status_post_is_about_this_runs(ctl):
    """After a run closed, the next run's post is about its own stages (regeneration while it runs, not the
    server), and the earlier run's finished training is labelled "(run r…, closed)" wherever it is listed."""
    add(ctl, "train", state="exited", exit_code=0, ended_at=9.0, reason="exit code 0")
    old = ctl.store.current_run()
    ctl.store.close_run(old, reason="training finished (exit 0)")
    new = ctl.store.open_run()
    add(ctl, "server")
    add(ctl, "regenerate")
    status = ctl.status(sample_if_unmonitored=False)
    text, _ = status_blocks(status, version=ctl.state_version())
    assert text.startswith("regenerate:"), text
    assert f"(run {old}, closed)" in status_text(status) and f"run: {new}" in status_text(status)
    stuck, _ = answer(ctl, "stuck", [], user="U1")
    assert f"*train* (run {old}, closed)" in stuck and f"*server* (run {new}" not in stuck


def test_unknown_always_says_why(ctl):
    """An ended stage whose end is not observed yet, and a verdict without reasons: the sentence says why."""
    from handlers.render.blocks import answer as sentence

    proc = add(ctl, "extract", state="exited", exit_code=1, ended_at=9.0, reason="exited with code 1")
    status = ctl.status(sample_if_unmonitored=False)
    text = sentence("extract", status.stages["extract"])
    assert text.startswith("Unknown: extract's state cannot be read now — ") and "exited with code 1" in text
    ctl.store.put_verdict("extract", StoredVerdict.from_json({"proc_id": proc, "verdict": "unknown", "reasons": [],
                                                              "t": 8.0, "final": True}))
    bare = sentence("extract", ctl.status(sample_if_unmonitored=False).stages["extract"])
    assert "exited with code 1" in bare and "(no reason recorded)" not in bare


def test_check_back_later_during_training_uses_trainings_eta_not_extractions_zero(ctl):
    ex = add(ctl, "extract", state="exited", exit_code=0, ended_at=5.0)
    ctl.store.put_verdict("extract", StoredVerdict.from_json({"proc_id": ex, "verdict": "done", "eta_s": 0.0,
                                                              "reasons": [], "final": True}))
    tr = add(ctl, "train")
    ctl.store.put_verdict("train", StoredVerdict.from_json({"proc_id": tr, "verdict": "progressing", "eta_s": 5400.0,
                                                            "reasons": []}))
    r = ctl.remind("eta", by="slack:U1")
    assert r["due_at"] - r["created_at"] == 5400.0
