"""The supervisor's state machine against a fake host (no real processes)."""

import json

import pytest

from pipeline.config import Workspace, parse_config
from pipeline.errors import StageError
from pipeline.stages.host import SIGKILL, SIGTERM, Member
from pipeline.stages.supervisor import RUNNER_START_TIMEOUT_S, Supervisor, claim_row, record_exit
from pipeline.store import Store


class FakeHost:
    """Scripted processes: pid -> (create_time, alive); members per pgid."""

    def __init__(self):
        self.now = 1000.0
        self.procs = {}  # pid -> create_time of the live process holding that pid
        self.groups = {}  # pgid -> list of member pids
        self.ignores_term = set()
        self.signals = []

    def clock(self):
        return self.now

    def sleep(self, s):
        self.now += s

    def identity(self, pid, create_time):
        if pid not in self.procs or create_time is None:
            return "gone"
        return "alive" if abs(self.procs[pid] - create_time) < 0.05 else "reused"

    def create_time(self, pid):
        return self.procs.get(pid)

    def members(self, pgid, since):
        return [Member(p, "fake", self.procs[p]) for p in self.groups.get(pgid, []) if p in self.procs]

    def kill(self, pid, sig, *, group):
        self.signals.append((pid, sig, group))
        targets = self.groups.get(pid, []) if group else [pid]
        for p in list(targets):
            if sig == SIGKILL or p not in self.ignores_term:
                self.procs.pop(p, None)

    def spawn_detached(self, argv, cwd=None):
        raise AssertionError("not used here")


@pytest.fixture
def setup(tmp_path):
    ws = Workspace(config=parse_config('[stages.train]\nargv = ["x"]\n', name="eagle3.toml"), path=tmp_path / "eagle3.toml")
    host = FakeHost()
    store = Store(tmp_path / "s.sqlite", clock=host.clock)
    return ws, host, store, Supervisor(workspace=ws, store=store, host=host)


def add_running(store, host, *, stage="train", pid=500, runner_pid=None):
    host.procs[pid] = 990.0
    host.groups[pid] = [pid]
    run = store.open_run()
    return store.insert_proc({"run_id": run, "stage": stage, "state": "running", "pid": pid, "pgid": pid,
                              "create_time": 990.0, "runner_pid": runner_pid, "runner_create_time": None,
                              "argv": json.dumps(["x"]), "started_at": 990.0, "stop_requested": 0})


def test_readopts_verified_stage(setup):
    ws, host, store, sup = setup
    add_running(store, host)
    sup.refresh()
    assert store.latest_proc("train").state == "running"


def test_reused_pid_is_not_the_stage_and_is_never_signalled(setup):
    ws, host, store, sup = setup
    add_running(store, host)
    host.procs[500] = 1500.0  # the pid now belongs to a newer process
    sup.refresh()
    proc = store.latest_proc("train")
    assert proc.state == "unknown"
    assert "exit status unknown" in proc.reason
    result = sup.stop("train", grace_s=1)
    assert host.signals == []
    assert "belongs to another process" in result.note
    assert 500 in host.procs


def test_stop_escalates_to_sigkill_and_records_stopped(setup):
    ws, host, store, sup = setup
    add_running(store, host)
    host.ignores_term.add(500)
    result = sup.stop("train", grace_s=2)
    assert result.escalated and not result.survivors
    assert [s[1] for s in host.signals if s[2]] == [SIGTERM, SIGKILL]
    proc = store.latest_proc("train")
    assert proc.state == "stopped" and proc.stop_requested == 1


def test_stop_without_escalation(setup):
    ws, host, store, sup = setup
    add_running(store, host)
    result = sup.stop("train", grace_s=2)
    assert not result.escalated
    assert all(s[1] == SIGTERM for s in host.signals)


def test_exit_after_requested_stop_is_stopped_and_keeps_the_run_open_to_resume(setup):
    ws, host, store, sup = setup
    proc_id = add_running(store, host)
    run = store.proc(proc_id).run_id
    store.update_proc(proc_id, stop_requested=1)
    record_exit(store, proc_id, returncode=137, now=host.now)
    proc = store.proc(proc_id)
    assert (proc.state, proc.exit_code) == ("stopped", 137)
    assert store.current_run() == run, "a stopped training is resumed within its run (its extraction)"
    failed = add_running(store, host, pid=501)
    record_exit(store, failed, returncode=1, now=host.now)
    assert store.current_run() == run, "a failed training too: the restart or relaunch resumes in the run"
    done = add_running(store, host, pid=502)
    record_exit(store, done, returncode=0, now=host.now)
    assert store.current_run() is None, "a training that finished closes its run"


def test_exit_code_and_signal_recorded(setup):
    ws, host, store, sup = setup
    proc_id = add_running(store, host, stage="extract")
    record_exit(store, proc_id, returncode=-9, now=host.now)
    proc = store.proc(proc_id)
    assert (proc.state, proc.exit_code, proc.signal) == ("exited", None, 9)
    assert store.current_run() is not None  # only training's end closes the run


def test_second_start_is_refused_while_running(setup):
    ws, host, store, sup = setup
    add_running(store, host)
    with pytest.raises(StageError, match="already running"):
        sup.start("train")


def test_illegal_transition_asserts(setup):
    from pipeline.states import StageState, transition
    ws, host, store, sup = setup
    proc_id = add_running(store, host)
    record_exit(store, proc_id, returncode=0, now=host.now)
    with pytest.raises(AssertionError, match="exited -> running"):
        transition(store, store.proc(proc_id), StageState.RUNNING)


def add_unstarted(store, host, *, runner_pid=None):
    """A row as `start` leaves it before any runner reported a pid."""
    return store.insert_proc({"run_id": store.open_run(), "stage": "train", "state": "running", "pid": None,
                              "runner_pid": runner_pid, "runner_create_time": host.procs.get(runner_pid),
                              "argv": json.dumps(["x"]), "started_at": host.now, "stop_requested": 0})


def test_a_row_no_runner_took_up_is_closed_as_never_started_after_the_timeout(setup):
    ws, host, store, sup = setup
    proc_id = add_unstarted(store, host)  # the service died between inserting the row and spawning
    sup.refresh()
    assert store.proc(proc_id).state == "running", "a runner may still take it up"
    host.now += RUNNER_START_TIMEOUT_S + 0.1
    sup.refresh()
    row = store.proc(proc_id)
    assert (row.state, row.exit_code) == ("exited", None)
    assert row.reason.startswith("never started: no runner took it up")
    assert claim_row(store, proc_id, runner_pid=77, runner_create_time=5.0) is None, "a late runner starts nothing"
    assert not sup.is_running("train")


def test_a_live_runner_keeps_its_row_open_and_a_dead_one_closes_it(setup):
    ws, host, store, sup = setup
    host.procs[77] = 995.0
    proc_id = add_unstarted(store, host, runner_pid=77)
    host.now += RUNNER_START_TIMEOUT_S + 5
    sup.refresh()
    assert store.proc(proc_id).state == "running"
    del host.procs[77]
    sup.refresh()
    row = store.proc(proc_id)
    assert row.state == "exited" and "its runner (pid 77) died before starting it" in row.reason


def test_a_runner_claims_only_an_open_row_without_a_stage(setup):
    ws, host, store, sup = setup
    proc_id = add_unstarted(store, host)
    assert claim_row(store, proc_id, runner_pid=77, runner_create_time=5.0).runner_pid == 77
    store.update_proc(proc_id, pid=600)
    assert claim_row(store, proc_id, runner_pid=78, runner_create_time=6.0) is None


def test_a_detached_runner_that_ends_leaves_no_zombie_in_a_long_lived_service():
    """serve spawns a runner for each start (the restart policy's relaunches too); when one ends it is reaped at
    once, not left a zombie until some later spawn."""
    import sys
    import time

    import psutil

    from pipeline.stages.host import RealHost

    pid = RealHost().spawn_detached([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE and None
        except psutil.NoSuchProcess:
            gone = True
        if gone:
            break
        time.sleep(0.05)
    assert gone, f"pid {pid} is still a zombie (or running) 20 s after it ended"
