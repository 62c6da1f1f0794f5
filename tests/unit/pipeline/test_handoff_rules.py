"""The handoff's rules that need no process: a handoff belongs to its run; training beside the server."""

from __future__ import annotations

import os

import psutil
import pytest

from pipeline.config import Workspace
from pipeline.controller import Controller, ServerHoldsGpusError, TrainGuardError
from pipeline.handoff import completion
from pipeline.handoff.machine import Handoff, handoff_state
from pipeline.states import StageProc, StageState
from pipeline.store import Store
from tests.conftest import workspace_of

pytestmark = pytest.mark.timeout(30)


# the config of the `ctl` fixture's controller (tests/conftest.py)
CONFIG = "[stages.server]\nargv = [\"x\"]\ngpus = [0, 1, 2, 3]\n[stages.train]\nargv = [\"y\"]\ngpus = [2, 3]\n"


def test_a_new_run_starts_with_auto_start_off(ctl):
    store = ctl.store
    first = store.open_run()
    assert ctl.autostart(True).changed
    assert handoff_state(store).run == first
    store.close_run(first, reason="all stages stopped")
    assert handoff_state(store).step == "armed", "with no run open, the last run's handoff still shows"
    store.open_run()
    assert handoff_state(store) is None and ctl.status(sample_if_unmonitored=False).autostart == "off"
    again = ctl.autostart(True)
    assert again.changed and again.state.run == store.current_run()


def test_autostart_configured_arms_each_new_run(tmp_path):
    ws = workspace_of(tmp_path, "[handoff]\nautostart = true\n")
    store = Store(ws.store_path)
    try:
        h = Handoff(ws=ws, store=store, supervisor=None)
        h.tick()
        assert handoff_state(store) is None, "no run: nothing to arm"
        store.open_run()
        h._arm_new_run()
        assert handoff_state(store).step == "armed" and "config" in handoff_state(store).reason
    finally:
        store.close()


def test_training_beside_a_server_holding_its_gpus_is_refused(ctl, monkeypatch):
    monkeypatch.setattr(completion, "check", lambda *a, **k: completion.Completion(complete=True, done=1, failed=0,
                                                                                   total=1))
    monkeypatch.setattr(ctl.supervisor, "start", lambda stage: StageProc(id=9, stage=stage, state=StageState.RUNNING, pid=1))
    store = ctl.store
    store.insert_proc({"run_id": store.open_run(), "stage": "server", "state": "running", "pid": os.getpid(),
                       "pgid": os.getpid(), "create_time": psutil.Process().create_time(), "argv": "[]",
                       "started_at": 0, "stop_requested": 0})
    with pytest.raises(ServerHoldsGpusError, match=rf"server \(pid {os.getpid()}\) is running and holds GPU 2, 3"):
        ctl.start("train")
    assert ctl.start("train", force=True).pid == 1
    audit = [(a["action"], a["outcome"]) for a in store.db["audit"].rows]
    assert audit == [("start train", "refused"), ("start train --force", "allowed")]


def test_a_stopped_stage_does_not_show_its_last_running_verdict(ctl):
    store = ctl.store
    run = store.open_run()
    proc_id = store.insert_proc({"run_id": run, "stage": "extract", "state": "stopped", "pid": None,
                                 "argv": "[]", "started_at": 0, "ended_at": 10, "stop_requested": 1,
                                 "reason": "exit code 0"})
    store.put("verdict:extract", {"proc_id": proc_id, "verdict": "progressing", "eta_s": 100.0, "reasons": ["x"],
                                  "t": 5})
    st = ctl.status(sample_if_unmonitored=False).to_json()["stages"]["extract"]
    assert st["verdict"] == "stopped" and st["eta_s"] is None
    assert st["reasons"] == ["stopped on request (exit code 0)"]


def test_a_launch_checked_against_a_cancel_in_its_own_transaction_starts_nothing(ctl):
    """The handoff decides to launch, a cancel commits, then the launch inserts its row: the check in
    the insert's transaction sees the cancel, so no training row (and no runner) appears after it."""
    before = ctl.store.latest_proc("train")
    assert ctl.supervisor.start("train", only_if=lambda: False) is None
    assert ctl.store.latest_proc("train") == before


# --- a workspace used by an earlier run (issue 30): only the current run's stages count -------------------

EXTRACT_OUT = "out"


def to_launching(h: Handoff) -> None:
    """Arm and walk the handoff through its edges to launching-training (the steps' own checks are tested apart)."""
    from pipeline.handoff.machine import GPU_WAIT, LAUNCHING, STOPPING, WAITING

    h.arm(by="test")
    for step in (WAITING, STOPPING, GPU_WAIT, LAUNCHING):
        h._set(step, "test")


def used_ws(tmp_path, extra: str = "") -> tuple[Workspace, Store]:
    """A workspace whose earlier run extracted 300 of 300 samples (exited 0, manifest complete) and closed."""
    import sqlite3

    from pipeline.manifest import SCHEMA

    text = (f"[stages.server]\nargv = [\"x\"]\n[stages.extract]\nargv = [\"y\"]\nout = \"{EXTRACT_OUT}\"\n"
            f"[stages.train]\nargv = [\"z\"]\n{extra}")
    ws = workspace_of(tmp_path, text)
    out = tmp_path / EXTRACT_OUT
    (out / "hidden_states").mkdir(parents=True)
    conn = sqlite3.connect(out / "manifest.sqlite", isolation_level=None)
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("samples_total", "300"), ("tokens_total", "30000")])
    conn.executemany("INSERT INTO samples (idx, status, tokens, bytes, attempts, finished_at) "
                     "VALUES (?, 'done', 100, 10, 1, 0)", [(i,) for i in range(300)])
    conn.close()
    store = Store(ws.store_path)
    old = store.open_run()
    for stage in ("server", "extract", "train"):
        add_proc(store, old, stage, state="exited", exit_code=0)
    store.close_run(old, reason="training finished (exit 0)")
    return ws, store


def add_proc(store: Store, run: str, stage: str, *, state: str = "running", exit_code: int | None = None) -> int:
    return store.insert_proc({"run_id": run, "stage": stage, "state": state, "pid": None, "argv": "[]",
                              "started_at": 0, "ended_at": 1 if state != "running" else None,
                              "exit_code": exit_code, "stop_requested": 0, "reason": "exit code 0"})


class RecordingSupervisor:
    """The handoff's supervisor, recording what it was asked to do (nothing here may be stopped or started)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def stop(self, stage, **kw):
        self.calls.append(("stop", stage))
        raise AssertionError(f"the handoff stopped {stage} on an earlier run's data")

    def start(self, stage, **kw):
        self.calls.append(("start", stage))
        raise AssertionError(f"the handoff started {stage} on an earlier run's data")

    def refresh(self) -> None:
        pass


@pytest.fixture
def verify_passes(monkeypatch):
    """The sample files' check passes: these tests are about which run's data counts, not the files."""
    from pipeline.extract import verify as verify_mod

    ok = type("R", (), {"ok": True, "checked": 1, "problems": []})()
    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: ok)


def steps(store: Store) -> list[str]:
    return [e["data"]["step"] for e in store.events(kind="handoff")]


def test_completion_reads_only_the_current_runs_extraction(tmp_path, verify_passes):
    ws, store = used_ws(tmp_path)
    try:
        c = completion.check(ws, store)
        assert not c.complete and c.missing == ["no run is open (extraction has not run since the last run closed)"]
        add_proc(store, store.open_run(), "server")  # `eagle3 start server`: a new run
        c = completion.check(ws, store)
        assert not c.complete and c.missing == ["extraction has not run in this run"]
        assert c.total is None, "the manifest on disk is the earlier run's: not this run's progress"
        add_proc(store, store.current_run(), "extract", state="exited", exit_code=0)
        assert completion.check(ws, store).complete, "this run's extraction (resumed: nothing left) counts"
    finally:
        store.close()


def test_autostart_true_in_a_used_workspace_waits_for_this_runs_extraction(tmp_path, verify_passes):
    ws, store = used_ws(tmp_path, "[handoff]\nautostart = true\n")
    try:
        add_proc(store, store.open_run(), "server")  # `eagle3 start server` alone
        h = Handoff(ws=ws, store=store, supervisor=RecordingSupervisor(), port_check=lambda port: True)
        for _ in range(3):
            h.tick()
        state = handoff_state(store)
        assert state.step == "waiting-for-completion"
        assert state.reason == "waiting: extraction has not run in this run"
        assert set(steps(store)) == {"armed", "waiting-for-completion"}, "the server was never stopped"
    finally:
        store.close()


def test_arming_between_runs_is_for_the_next_run_and_never_acts_on_the_last(tmp_path, verify_passes):
    ws, store = used_ws(tmp_path)
    ctl = Controller(workspace=ws, store=store)
    try:
        result = ctl.autostart(True, by="cli:ana")
        from handlers.render.views import autostart_text

        assert autostart_text(result).startswith("auto-start armed for the next run: armed by cli:ana")
        h = Handoff(ws=ws, store=store, supervisor=RecordingSupervisor(), port_check=lambda port: True)
        h.tick()
        assert handoff_state(store).step == "armed", "no run open: nothing to wait for yet"
        run = store.open_run()
        add_proc(store, run, "server")
        h.tick()
        h.tick()
        state = handoff_state(store)
        assert (state.run, state.step) == (run, "waiting-for-completion")
        assert "extraction has not run in this run" in state.reason
        assert ctl.status(sample_if_unmonitored=False).autostart == "waiting-for-completion"
    finally:
        ctl.close()
        store.close()


def test_training_started_by_hand_sets_off_no_handoff(tmp_path, verify_passes):
    ws, store = used_ws(tmp_path, "[handoff]\nautostart = true\n")
    try:
        add_proc(store, store.open_run(), "train")  # `eagle3 start train` (a resume) opens the run
        h = Handoff(ws=ws, store=store, supervisor=RecordingSupervisor(), port_check=lambda port: True)
        for _ in range(3):
            h.tick()
        assert handoff_state(store) is None and steps(store) == []
        assert Controller(workspace=ws, store=store).status(sample_if_unmonitored=False).autostart == "off"
    finally:
        store.close()


def test_training_started_by_hand_while_armed_makes_the_handoff_stand_down(tmp_path, verify_passes):
    ws, store = used_ws(tmp_path)
    try:
        run = store.open_run()
        add_proc(store, run, "server")
        h = Handoff(ws=ws, store=store, supervisor=RecordingSupervisor(), port_check=lambda port: True)
        h.arm(by="cli:ana")
        h.tick()
        add_proc(store, run, "train")
        h.tick()
        state = handoff_state(store)
        assert state.step == "cancelled" and "started by hand" in state.reason
    finally:
        store.close()


def test_the_handoff_moves_only_along_its_edge_table(tmp_path):
    """One style for both machines (issue 36): the handoff has an edge table like the stages', and `_set` refuses
    a step that is not an edge from the current one."""
    from pipeline.states import (
        ARMED,
        CANCELLED,
        TRAINING_DONE,
        WAITING,
        HandoffStep,
    )
    from pipeline.states import HANDOFF_EDGES as _EDGES

    ws, store = used_ws(tmp_path)
    try:
        h = Handoff(ws=ws, store=store, supervisor=None)
        assert h.arm(by="test")[1].step == ARMED
        with pytest.raises(AssertionError, match="illegal handoff transition armed -> training-done"):
            h._set(TRAINING_DONE, "skipping the whole handoff")
        assert h.state().step == ARMED
        h._set(WAITING, "watched")
        h._set(WAITING, "a new reason, the same step")
        assert h.cancel(by="test")[1].step == CANCELLED
    finally:
        store.close()
    reachable, frontier = set(), {None}
    while frontier:
        frontier = {b for a, b in _EDGES if a in frontier} - reachable
        reachable |= frontier
    assert reachable == set(HandoffStep)  # every step is reachable from off, and only through edges


def test_the_restart_policy_keeps_its_backoff_count_and_limit_on_the_process_row(tmp_path):
    """Issue 36: backoff and giving up are the row's state (restart_due, restart_count, restart_given_up), not kv
    entries; a restart carries the count to the row it starts; the limit is said once."""
    from pipeline.automation import Automation

    text = ('[stages.server]\nargv = ["x"]\nrestart = "on-failure"\nrestart_backoff_s = 10\nmax_restarts = 2\n')
    ws = workspace_of(tmp_path, text)
    store = Store(ws.store_path)
    now = [1000.0]
    auto = Automation(ws=ws, store=store, clock=lambda: now[0])
    started = []

    def start(stage, *, restart_count=0, **_):
        started.append(restart_count)
        pid = store.insert_proc({"run_id": run, "stage": stage, "state": "exited", "exit_code": 1, "argv": "[]",
                                 "started_at": now[0], "ended_at": now[0], "restart_count": restart_count})
        return store.proc(pid)

    auto.sup.start = start
    run = store.open_run()
    store.insert_proc({"run_id": run, "stage": "server", "state": "exited", "exit_code": 1, "argv": "[]",
                       "started_at": 990.0, "ended_at": 1000.0})
    try:
        auto.restart_policy()
        row = store.latest_proc("server")
        assert started == [] and row.restart_due == 1010.0 and row.in_backoff  # 10 s · 2⁰
        now[0] = 1010.0
        auto.restart_policy()
        assert started == [1] and store.latest_proc("server").restart_count == 1
        auto.restart_policy()  # the new row died at once: its backoff doubles
        assert started == [1] and store.latest_proc("server").restart_due == 1030.0
        now[0] = 1030.0
        auto.restart_policy()
        assert started == [1, 2]
        for _ in range(2):  # at its limit: given up, said once
            auto.restart_policy()
        last = store.latest_proc("server")
        assert started == [1, 2] and last.restart_given_up and not last.in_backoff
        assert [e["kind"] for e in store.events(kind="restart-limit")] == ["restart-limit"]
        assert Controller(workspace=ws, store=store).restarts("server") == {"policy": 2, "hand": 0}
    finally:
        store.close()


def test_an_exit_2_is_final_and_never_restarted(tmp_path):
    """A usage, configuration or input error (exit 2: a dataset of another hash, a flag mistake) is given up at once
    with the reason and the way out, not retried `max_restarts` times; another exit code still restarts."""
    from pipeline.automation import Automation

    ws = workspace_of(tmp_path, '[stages.extract]\nargv = ["x"]\nrestart = "on-failure"\nrestart_backoff_s = 0\n')
    store = Store(ws.store_path)
    auto = Automation(ws=ws, store=store, clock=lambda: 1000.0)
    started = []
    auto.sup.start = lambda stage, **_: started.append(stage)
    run = store.open_run()
    store.insert_proc({"run_id": run, "stage": "extract", "state": "exited", "exit_code": 2, "argv": "[]",
                       "started_at": 990.0, "ended_at": 1000.0, "reason": "exited with code 2"})
    try:
        auto.restart_policy()
        auto.restart_policy()
        assert started == [] and store.latest_proc("extract").restart_given_up
        (event,) = store.events(kind="restart-limit")
        assert "no restart fixes" in event["data"]["reason"] and "eagle3 start extract" in event["data"]["reason"]
    finally:
        store.close()


def test_start_train_with_no_run_open_trains_on_the_last_runs_verified_extraction(tmp_path, verify_passes):
    """extract → `stop --all` (which closes the run) → `start train`: it trains on that run's verified extraction,
    reopening the run (so its checkpoints and `{run}` paths are that run's), with no --force; where the last run's
    extraction is not verified complete, the refusal names that run and why."""
    ws, store = used_ws(tmp_path)
    ctl = Controller(workspace=ws, store=store)
    started = []

    def start(stage, **_):
        started.append((stage, store.current_run()))
        return store.proc(add_proc(store, store.open_run(), stage))

    ctl.supervisor.start = start
    try:
        (closed, _), = store.db.execute("SELECT id, close_reason FROM runs").fetchall()
        add_proc(store, closed, "extract", state="exited", exit_code=0)  # that run's extraction, verified complete
        proc = ctl.start("train", by="test")
        assert started == [("train", closed)] and proc.reopened == closed and proc.run_id == closed
        assert [e["run_id"] for e in store.events(kind="run-reopened")] == [closed]

        store.close_run(closed, reason="all stages stopped")
        store.db.execute("UPDATE stage_procs SET exit_code = 1 WHERE stage = 'extract'")
        with pytest.raises(TrainGuardError) as refused:
            ctl.start("train", by="test")
        (why,) = refused.value.completion.missing
        assert f"the last run {closed} (closed: all stages stopped) has no verified extraction" in why
        assert "did not exit 0" in why and store.current_run() is None and len(started) == 1
    finally:
        store.close()


def test_a_restart_of_training_by_hand_is_followed_to_its_end_not_taken_for_a_cancel(tmp_path, verify_passes):
    """Auto-start launched training; the operator restarts it (`/eagle3 restart train`): the stop of the restart is
    not the training's end — the handoff follows the new process and ends `training-done` with the draft, and the
    ending's duration counts from the run's first start of training, not from the restart."""
    from bot.notifier import Notifier
    from pipeline.handoff.machine import TRAINING, TRAINING_DONE

    ws, store = used_ws(tmp_path)
    now = [1000.0]
    sup = type("S", (), {"refresh": lambda self: None})()
    h = Handoff(ws=ws, store=store, supervisor=sup, clock=lambda: now[0])
    try:
        run = store.open_run()
        to_launching(h)
        first = store.insert_proc({"run_id": run, "stage": "train", "state": "running", "argv": "[]",
                                   "started_at": 100.0, "stop_requested": 0})
        h._set(TRAINING, "launched", train_proc_id=first)
        store.put("restarting:train", {"of": first, "t": now[0]})  # Controller.restart, under way
        store.update_proc(first, state="stopped", stop_requested=1, ended_at=1000.0, reason="stopped on request")
        h._training(h.state())
        assert h.state().step == TRAINING, "the restart's stop is not a cancel"
        second = store.insert_proc({"run_id": run, "stage": "train", "state": "running", "argv": "[]",
                                    "started_at": 1001.0, "stop_requested": 0})
        store.put("restarting:train", None)
        h._training(h.state())
        assert h.state().train_proc_id == second and "restarted" in h.state().reason
        store.update_proc(second, state="exited", exit_code=0, ended_at=1061.0)
        h._training(h.state())
        assert h.state().step == TRAINING_DONE
        ending = store.events(kind="handoff")[-1]
        assert Notifier._took(type("N", (), {})(), store, ending) == 961.0  # 100 → 1061, not the last minute
    finally:
        store.close()


def test_while_regeneration_runs_the_guard_says_so_with_its_count_not_start_extract(tmp_path, verify_passes):
    from handlers.render.views import train_guard_text

    ws, store = used_ws(tmp_path)
    try:
        run = store.open_run()
        regen = store.insert_proc({"run_id": run, "stage": "regenerate", "state": "running", "argv": "[]",
                                   "started_at": 1.0, "stop_requested": 0})
        store.put("verdict:regenerate", {"proc_id": regen, "run": run, "verdict": "progressing", "done": 89,
                                         "failed": 0, "total": 241})
        c = completion.check(ws, store)
        assert c.missing == ["waiting for regeneration (89 / 241 conversations): extraction follows it, by itself "
                             "when auto-start is armed"]
        text = train_guard_text(c)
        assert "regeneration is still running" in text and "start extract" not in text
    finally:
        store.close()


def test_a_restart_by_hand_is_counted_apart_from_the_policys_and_per_run(tmp_path):
    ws, store = used_ws(tmp_path)
    try:
        ctl = Controller(workspace=ws, store=store)
        run = store.open_run()
        ctl.stop = lambda stage, by: "stopped"  # the stop and start themselves are tested with real processes
        ctl.start = lambda stage, by: "started"
        assert ctl.restart("extract", by="slack:U1") == ("stopped", "started")
        assert ctl.restarts("extract") == {"policy": 0, "hand": 1} and ctl.restarts("train") == {"policy": 0, "hand": 0}
        store.close_run(run, reason="all stages stopped")
        store.open_run()
        assert ctl.restarts("extract") == {"policy": 0, "hand": 0}, "a new run counts from 0"
    finally:
        store.close()


def test_a_cancel_that_lands_while_a_step_notes_its_news_is_never_written_over(tmp_path):
    """Found by the suite under load: the launch step's "retrying in 2 s" note read the state, another process's
    `autostart off` committed the cancel, and the note wrote the stale launching-training state back — which then
    launched training after the operator was told it would not. The note reads and writes in one transaction,
    and only for the step its caller was in."""
    import threading

    from pipeline.handoff.machine import CANCELLED, LAUNCHING

    ws, store = used_ws(tmp_path)
    sup = type("S", (), {"refresh": lambda self: None})()
    h = Handoff(ws=ws, store=store, supervisor=sup)

    def autostart_off():  # `eagle3 autostart off`: another process, its own connection
        other = Store(ws.store_path, check_integrity=False)
        try:
            Handoff(ws=ws, store=other, supervisor=sup).cancel(by="cli")
        finally:
            other.close()

    try:
        store.open_run()
        to_launching(h)
        h._set(LAUNCHING, "launch attempt 1 of 3 failed (x); retrying in 3 s")
        canceller = threading.Thread(target=autostart_off)
        read = h.state

        def state_then_cancel():  # the cancel commits right after the note's read, as it did in the suite
            s = read()
            if not canceller.is_alive() and canceller.ident is None:
                canceller.start()
                canceller.join(timeout=0.5)
            return s

        h.state = state_then_cancel
        h._note("launch attempt 1 of 3 failed (x); retrying in 2 s", step=LAUNCHING)
        canceller.join(timeout=10)
        h.state = read
        assert handoff_state(store).step == CANCELLED
        h._note("launch attempt 1 of 3 failed (x); retrying in 1 s", step=LAUNCHING)  # a tick that read it before
        assert handoff_state(store).step == CANCELLED and handoff_state(store).reason == "cancelled by cli"
    finally:
        store.close()
