"""Why is it stuck, in parts: the flight recorder's summary (PyTorch's dump shape), where a py-spy dump says a process is,
and the extraction client's own account over its socket."""

import json
import os

import pytest

from pipeline.train import flight

pytestmark = pytest.mark.timeout(30)


NOW = 1_800_000_000.0


def dump(enqueued: int, completed: int, op: str = "nccl:all_reduce", pg: str = "0", entered: float = NOW - 372) -> dict:
    entries = [{"collective_seq_id": n, "pg_id": int(pg), "profiling_name": op if n == enqueued else "nccl:broadcast",
                "is_p2p": False, "state": "scheduled", "retired": n <= completed,
                "time_created_ns": int((entered - (enqueued - n)) * 1e9)} for n in range(1, enqueued + 1)]
    return {"pg_status": {pg: {"last_enqueued_collective": str(enqueued), "last_completed_collective": str(completed),
                               "last_started_collective": "-1"}}, "entries": entries}


def test_the_rank_behind_is_named_with_the_collective_the_others_wait_in():
    dumps = {r: dump(18245, 18244) for r in range(8)}
    dumps[3] = dump(18244, 18244)
    assert flight.summarize(dumps, NOW) == [
        "ranks 0–2, 4–7 wait in all_reduce #18,245 for 6m12s; rank 3 is at #18,244 → rank 3 is behind"]


def test_all_ranks_in_the_same_collective_blame_the_collective_not_a_rank():
    assert flight.summarize({0: dump(9, 8), 1: dump(9, 8)}, NOW) == [
        "every rank has been in all_reduce #9 for 6m12s and none is behind: the collective itself does not complete "
        "(the network, or a rank's device)"]
    assert flight.summarize({0: dump(9, 9), 1: dump(9, 9)}, NOW) == [
        "every rank has finished all_reduce #9, entered 6m12s ago: none waits in a collective"]


def test_a_busy_run_caught_between_two_collectives_is_moving_not_stuck():
    """Dumps of a healthy run are taken at slightly different instants: a rank one collective ahead, entered a
    moment ago, is work, not a rank behind."""
    assert flight.summarize({0: dump(6187, 6186, entered=NOW - 0.1), 1: dump(6186, 6186, entered=NOW - 0.2)},
                            NOW) == ["collectives are moving: the ranks are at all_reduce #6,186–#6,187, entered 0.1s ago"]


def test_a_rank_that_did_not_dump_is_said_and_the_others_still_summarised(tmp_path):
    (tmp_path / "rank_0.json").write_text(json.dumps(dump(5, 4)))
    (tmp_path / "rank_2.json").write_text(json.dumps(dump(4, 4)))
    (tmp_path / "rank_1.json").write_text(json.dumps(dump(5, 4)))
    os.utime(tmp_path / "rank_1.json", (100, 100))  # an earlier knock's answer: not this one's
    lines = flight.summarize(flight.read_dumps(tmp_path, [0, 1, 2, 3], since=1000), NOW)
    assert lines[0].startswith("rank 1: no dump yet (the rank's Python did not run")
    assert lines[1].startswith("rank 3: no dump yet")
    assert lines[2] == "rank 0 waits in all_reduce #5 for 6m12s; rank 2 is at #4 → rank 2 is behind"


def test_a_knock_on_a_fifo_nobody_reads_never_blocks(tmp_path):
    os.mkfifo(tmp_path / "rank_0.request")
    (tmp_path / "rank_1.json").write_text("{}")  # not a request: ignored
    assert flight.request_dumps(tmp_path) == []  # ENXIO: the rank has ended, nothing is waited for
    assert flight.request_dumps(tmp_path / "missing") == []


def test_the_recorder_is_on_for_training_only_and_the_stage_s_own_env_wins(tmp_path):
    from pipeline.config import load_workspace
    from pipeline.stages.host import stage_env

    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[stages.train]\nout = "ckpt"\nargv = ["true"]\nenv = { TORCH_FR_BUFFER_SIZE = "50" }\n'
                   '[stages.extract]\nout = "out"\nargv = ["true"]\n')
    ws = load_workspace(cfg)
    env = stage_env(ws, "train", run="r7")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(ws.state_dir / "forensics" / "r7" / "flight-recorder" / "rank_")
    assert env["TORCH_FR_BUFFER_SIZE"] == "50" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in stage_env(ws, "extract", run="r7")


DUMP = """Process 10: python -m pipeline.extract.parse_worker 9
Python v3.11.7 (/usr/bin/python3.11)

Thread 10 (idle): "MainThread"
    _read_exact (pipeline/extract/parse_worker.py:44)
    serve (pipeline/extract/parse_worker.py:155)
Thread 11 (idle): "ThreadPoolExecutor-0_0"
    SyncStream.read (httpcore/_backends/sync.py:128)
    _request (pipeline/extract/parse_worker.py:89)
Thread 12 (idle): "ThreadPoolExecutor-0_1"
    SyncStream.read (httpcore/_backends/sync.py:128)
Thread 13 (idle): "extract-state"
    socket.accept (socket.py:294)
Thread 14 (idle): "RendezvousKeepAliveTimer_0"
    Condition.wait (threading.py:331)
"""


def test_a_process_is_where_its_main_thread_is_and_where_its_other_threads_wait():
    from pipeline.observe.forensics import innermost

    assert innermost(DUMP) == ("_read_exact (pipeline/extract/parse_worker.py:44), "
                               "2 threads in SyncStream.read (httpcore/_backends/sync.py:128)")
    assert innermost("Process 1: x\n") is None


def test_the_client_s_account_says_who_holds_its_requests():
    from pipeline.observe.forensics import ServerLoad, client_summary

    now = 10_000.0
    state = {"loop_beat": now - 0.3, "in_flight": [{"sample": 7, "since": now - 372, "tokens": 4096, "worker": 3},
                                                   {"sample": 9, "since": now - 10, "tokens": 80, "worker": 3}],
             "last_written": {"sample": 6, "t": now - 380}, "server_up": True, "workers": [{"pid": 3, "exit": None}]}
    assert client_summary(state, ServerLoad(running=2, waiting=0, source="/v1/loads"), now) == [
        "client: 2 requests in flight, the oldest 6m12s (sample 7, 4,096 tokens); the server runs 2, queues 0: the "
        "server holds them; the last sample written 6m20s ago (sample 6)"]
    assert client_summary(state, ServerLoad(running=0, waiting=0), now)[0].endswith(
        "the server has none of them (lost between the client and the server); the last sample written 6m20s ago "
        "(sample 6)")
    assert "the server's own count is unknown" in client_summary(state, None, now)[0]
    blocked = {**state, "loop_beat": now - 45, "in_flight": [], "waiting": 0,
               "workers": [{"pid": 3, "exit": -9}]}
    assert client_summary(blocked, None, now) == [
        "client: its event loop has not run for 45s: it is blocked in a call (its stack, below, shows which)",
        "client: no request in flight: no sample waits to be sent; the last sample written 6m20s ago (sample 6)",
        "client: parse worker(s) ended: pid 3 (exit -9)"]
    assert client_summary(None, None, now) == [
        "client: its own state could not be read (not eagle3's extraction client, or it has ended)"]


def test_the_client_answers_its_state_from_a_thread_and_a_failing_snapshot_says_why():
    from pipeline.observe.probes.client_state import StateServer, ask

    told = StateServer(os.getpid(), lambda: {"in_flight": [], "t": 1.0})
    try:
        assert ask(os.getpid()) == {"in_flight": [], "t": 1.0}
    finally:
        told.close()
    assert ask(os.getpid()) is None  # closed: nobody answers under that name

    def broken() -> dict:
        raise RuntimeError("mid-change")

    told = StateServer(os.getpid(), broken)
    try:
        assert ask(os.getpid()) == {"error": "RuntimeError: mid-change"}
    finally:
        told.close()


def test_the_client_s_state_reads_as_lines():
    from pipeline.observe.forensics import client_text

    now = 10_000.0
    state = {"loop_beat": now - 0.2, "in_flight": [{"sample": 24, "since": now - 6.7, "tokens": 229, "worker": 8604}],
             "waiting": 8, "storing": 0, "remaining": 36, "budget_bytes": 5.96e9, "inflight_bytes": 6.25e6,
             "server_up": True, "stopping": False, "last_written": {"sample": 23, "t": now - 6.7},
             "workers": [{"pid": 8604, "requests": 4, "exit": None}]}
    assert client_text(state, now).splitlines() == [
        "in flight (1):", "  sample 24 (229 tokens) for 6s, parse worker 8604",
        "waiting to be sent: 8; being stored: 0; not yet recorded: 36", "in-flight memory: 6.2 MB of 5.96 GB",
        "server reachable: yes; stopping: no", "last sample written: 23, 6s ago", "event loop's last turn: 0s before the ask",
        "parse worker 8604: 4 request(s), running"]


def test_no_permission_to_read_a_stack_is_one_line_naming_ptrace_scope(tmp_path):
    """py-spy's own words when ptrace is refused (a real binary that answers as py-spy does)."""
    from pipeline.observe.forensics import dump_stack

    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\necho 'Error: Failed to copy PyInterpreterState from process' >&2\n"
                   "echo 'Reason: Permission denied (os error 13)' >&2\nexit 1\n")
    spy.chmod(0o755)
    text, why = dump_stack(os.getpid(), binary=str(spy))
    assert text == "" and why.startswith(f"no permission to read process {os.getpid()}'s stack (kernel.yama.ptrace_scope")
    assert "run eagle3 serve as root or as the stage's user): Reason: Permission denied (os error 13)" in why
