"""Verdicts and handoff steps: typed values whose predicates are defined once, stored and shown as strings."""
from __future__ import annotations

import json

import pytest

from handlers.render.alerts import event_message
from pipeline.handoff.machine import CANCELLABLE, FOLLOWED, HandoffStep
from pipeline.observe.verdict import VERDICTS, Verdict, VerdictRecord


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


@pytest.mark.parametrize("frm,to,kind", [("progressing", "stalled", "alert"), ("slow", "dead", "alert"),
                                         ("stalled", "progressing", "recovery"), ("dead", "starting", "recovery"),
                                         ("stalled", "stopped", None), ("progressing", "slow", None),
                                         ("progressing", "done", "done"), (None, "a-verdict-from-a-newer-version", None)])
def test_verdict_events_page_recover_or_stay_quiet_by_the_predicates(frm, to, kind):
    msg = event_message({"kind": "verdict", "stage": "extract", "data": {"from": frm, "to": to, "reasons": []}},
                        oncall=["U1"])
    assert (msg[0] if msg else None) == kind
