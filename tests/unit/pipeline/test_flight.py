"""The flight recorder's summary: which rank waits in which collective, which are behind (PyTorch's dump shape)."""

import json
import os

import pytest

from pipeline.train import flight

pytestmark = pytest.mark.timeout(30)


def dump(enqueued: int, completed: int, op: str = "nccl:all_reduce", pg: str = "0") -> dict:
    entries = [{"collective_seq_id": n, "pg_id": int(pg), "profiling_name": op if n == enqueued else "nccl:broadcast",
                "is_p2p": False, "state": "scheduled", "retired": n <= completed} for n in range(1, enqueued + 1)]
    return {"pg_status": {pg: {"last_enqueued_collective": str(enqueued), "last_completed_collective": str(completed),
                               "last_started_collective": "-1"}}, "entries": entries}


def test_the_rank_behind_is_named_with_the_collective_the_others_wait_in():
    dumps = {r: dump(18245, 18244) for r in range(8)}
    dumps[3] = dump(18244, 18244)
    assert flight.summarize(dumps) == [
        "ranks 0–2, 4–7 wait in all_reduce #18,245; rank 3 is at #18,244 → rank 3 is behind"]


def test_all_ranks_in_the_same_collective_blame_the_collective_not_a_rank():
    assert flight.summarize({0: dump(9, 8), 1: dump(9, 8)}) == [
        "every rank is in all_reduce #9 and none is behind: the collective itself does not complete (the network, "
        "or a rank's device)"]
    assert flight.summarize({0: dump(9, 9), 1: dump(9, 9)}) == [
        "every rank has finished all_reduce #9: none waits in a collective"]


def test_a_rank_that_did_not_dump_is_said_and_the_others_still_summarised(tmp_path):
    (tmp_path / "rank_0.json").write_text(json.dumps(dump(5, 4)))
    (tmp_path / "rank_2.json").write_text(json.dumps(dump(4, 4)))
    (tmp_path / "rank_1.json").write_text(json.dumps(dump(5, 4)))
    os.utime(tmp_path / "rank_1.json", (100, 100))  # an earlier knock's answer: not this one's
    lines = flight.summarize(flight.read_dumps(tmp_path, [0, 1, 2, 3], since=1000))
    assert lines[0].startswith("rank 1: no dump yet (the rank's Python did not run")
    assert lines[1].startswith("rank 3: no dump yet")
    assert lines[2] == "rank 0 waits in all_reduce #5; rank 2 is at #4 → rank 2 is behind"


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
