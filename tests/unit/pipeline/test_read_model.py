"""Verdicts and handoff steps: typed values whose predicates are defined once, stored and shown as strings."""
from __future__ import annotations

import json

import pytest

from handlers.render.alerts import event_message
from pipeline.states import CANCELLABLE, FOLLOWED, HandoffState, HandoffStep, StateVersion
from pipeline.verdict import VERDICTS, StoredVerdict, Verdict, VerdictRecord


def test_the_verdicts_are_the_documented_strings_and_only_stalled_and_dead_are_stuck():
    assert VERDICTS == ("starting", "progressing", "slow", "stalled", "stopped", "dead", "done", "unknown")
    assert {v for v in Verdict if v.stuck} == {"stalled", "dead"}
    assert {v for v in Verdict if v.working} == {"starting", "progressing", "slow"}
    assert Verdict.of("stalled") is Verdict.STALLED and Verdict.of(None) is None and Verdict.of("wedged") is None


def test_a_record_takes_the_verdict_by_name_refuses_an_unknown_one_and_replays_as_before():
    r = VerdictRecord(t=5.0, stage="extract", verdict="dead", reasons=("exit 1",))
    assert r.verdict is Verdict.DEAD and r.stuck
    assert json.loads(json.dumps(r.replay_json()))["verdict"] == "dead"
    with pytest.raises(ValueError):
        VerdictRecord(t=5.0, stage="extract", verdict="wedged")


def test_handoff_steps_cancellable_followed_and_final():
    assert CANCELLABLE == {"armed", "waiting-for-completion", "stopping-server", "waiting-for-gpu-release",
                           "launching-training"}
    assert FOLLOWED == CANCELLABLE | {"training-running"}
    assert {s for s in HandoffStep if s.final} == {"training-done", "training-failed", "failed", "cancelled"}
    assert "armed" in CANCELLABLE and "training-running" not in CANCELLABLE  # a stored str finds its step
    assert json.dumps({"step": HandoffStep.GPU_WAIT}) == '{"step": "waiting-for-gpu-release"}'


def test_the_handoffs_record_reads_what_an_earlier_version_stored_and_writes_the_same_json(tmp_path):
    """The store's JSON is the contract across versions: an entry written before the record was typed (a dict
    with a key no longer used, one without `for_next_run`) reads, and a record writes back what it read."""
    from pipeline.store import KV, Store

    store = Store(tmp_path / "s.db")
    try:
        stored = {"run": "r1", "step": "waiting-for-gpu-release", "reason": "port 30000 still in use",
                  "gpu_wait_since": 1000.0, "train_floor": 3, "an_old_key": 1}
        store.put(KV.HANDOFF, stored)
        state = store.handoff()
        assert state is not None and state.step is HandoffStep.GPU_WAIT and state.cancellable and state.followed
        assert (state.run, state.train_floor, state.for_next_run, state.train_proc_id) == ("r1", 3, False, None)
        store.put_handoff(state)
        again = store.get(KV.HANDOFF)
        kept = {k: v for k, v in stored.items() if k != "an_old_key"}
        assert {k: again[k] for k in kept} == kept and "an_old_key" not in again
        assert state.of_run("r1") is state and state.of_run("r2") is None and state.of_run(None) is state
        assert HandoffState(run=None, step=HandoffStep.ARMED).of_run("r2") is not None  # armed for the next run
        assert HandoffState.from_json(None) is None and HandoffState.from_json({}) is None
        assert HandoffState(step=HandoffStep.CANCELLED).shown == "off" and HandoffState().shown == "off"
    finally:
        store.close()


def test_a_buttons_version_is_the_run_and_the_step_and_a_foreign_value_is_none():
    v = StateVersion(run="r20261206-1", step=HandoffStep.WAITING)
    assert str(v) == "r20261206-1:waiting-for-completion" and StateVersion.parse(str(v)) == v and v.cancellable
    off = StateVersion(run=None, step=None)
    assert str(off) == "None:off" and StateVersion.parse("None:off") == off and not off.cancellable
    assert StateVersion.parse("r1:training-done") == StateVersion(run="r1", step=HandoffStep.TRAINING_DONE)
    for foreign in (None, "", "v", "r1:a-step-from-a-newer-version"):
        assert StateVersion.parse(foreign) is None, foreign


@pytest.mark.parametrize("frm,to,kind", [("progressing", "stalled", "alert"), ("slow", "dead", "alert"),
                                         ("stalled", "progressing", "recovery"), ("dead", "starting", "recovery"),
                                         ("stalled", "stopped", None), ("progressing", "slow", None),
                                         ("progressing", "done", "ending"), (None, "a-verdict-from-a-newer-version", None)])
def test_verdict_events_page_recover_or_stay_quiet_by_the_predicates(frm, to, kind):
    msg = event_message({"kind": "verdict", "stage": "extract", "data": {"from": frm, "to": to, "reasons": []}},
                        oncall=["U1"])
    assert (msg[0] if msg else None) == kind


# The `status --json` contract, key for key, as each branch has always written it.
NOT_STARTED = ["state", "pid", "exit_code", "signal", "started_at", "ended_at", "uptime_s", "log", "reason", "run"]
UNOBSERVED = NOT_STARTED + ["stop_requested", "verdict", "progress_pct", "eta_s", "reasons"]
OBSERVED = NOT_STARTED + ["stop_requested", "verdict", "stuck", "progress_pct", "eta_s", "eta_low_s", "eta_high_s",
                          "reasons", "done", "failed", "total", "rate_samples_per_s", "rate_tokens_per_s",
                          "last_progress_at", "eta_note", "observed_at", "gpus", "server", "disk", "progress"]
RUN = ["run", "monitor", "autostart", "autostart_reason", "outbox", "transport", "slack_auth", "stages"]


def test_the_status_json_keeps_each_branchs_keys_and_reads_back(tmp_path):
    from pipeline.config import Workspace, parse_config
    from pipeline.controller import Controller
    from pipeline.status import RunStatus

    text = "[stages.server]\nargv = [\"x\"]\n[stages.extract]\nargv = [\"y\"]\n"
    ctl = Controller(workspace=Workspace(config=parse_config(text, name="t.toml"), path=tmp_path / "t.toml"))
    try:
        store = ctl.store
        run = store.open_run()
        for stage in ("server", "extract"):
            store.insert_proc({"run_id": run, "stage": stage, "state": "exited", "pid": 7, "argv": "[]",
                               "started_at": 1.0, "ended_at": 9.0, "exit_code": 0, "reason": "exit code 0"})
        extract = store.latest_proc("extract").id
        store.put_verdict("extract", StoredVerdict.from_json({
            "proc_id": extract, "verdict": "done", "stuck": False, "progress_pct": 100.0, "reasons": ["exited 0"],
            "t": 9.5, "done": 10, "total": 10}))
        status = ctl.status(sample_if_unmonitored=False)
        out = json.loads(json.dumps(status.to_json()))
    finally:
        ctl.close()
    assert list(out) == RUN and out["run"] == run
    assert list(out["stages"]["train"]) == NOT_STARTED and out["stages"]["train"]["state"] == "not-started"
    assert list(out["stages"]["server"]) == UNOBSERVED
    assert out["stages"]["server"]["verdict"] == "unknown" and out["stages"]["server"]["reasons"] == ["ended (exit code 0); not observed since"]
    assert list(out["stages"]["extract"]) == OBSERVED
    assert out["stages"]["extract"]["verdict"] == "done" and out["stages"]["extract"]["observed_at"] == 9.5
    # typed on the way in: the views read attributes and predicates, never keys
    ex = status.stages["extract"]
    assert ex.verdict is Verdict.DONE and ex.started and not ex.running and ex.processed == 10
    assert RunStatus.from_json(out).to_json() == out
    armed = RunStatus.from_json({**out, "autostart": "waiting-for-completion"})
    assert armed.handoff is HandoffStep.WAITING and armed.autostart_cancellable  # the typed step, from the JSON's
    assert RunStatus.from_json(out).handoff is None and not RunStatus.from_json(out).autostart_cancellable
