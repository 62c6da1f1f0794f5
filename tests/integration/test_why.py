""""Why is it stuck?" (issue 52, in part): `eagle3 why STAGE` over a real stage process and the real py-spy."""

from __future__ import annotations

import json
import re
import time

import pytest

from pipeline.train import flight
from tests.conftest import eagle3, fixture_argv, wait_for

pytestmark = pytest.mark.timeout(120)


def stage_cfg(tmp_path):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(f'[stages.extract]\nout = "out"\nargv = {json.dumps(fixture_argv("waits_in.py"))}\n')
    return cfg


def test_why_names_the_frame_each_process_waits_in_and_keeps_the_evidence(tmp_path):
    cfg = stage_cfg(tmp_path)
    assert eagle3("start", "extract", "--config", str(cfg)).returncode == 0
    try:
        log = tmp_path / ".eagle3" / "logs" / "extract.log"
        wait_for(lambda: log.exists() and "waiting in the collective" in log.read_text(), timeout=30,
                 what="the stage to reach its wait")
        out = eagle3("why", "extract", "--config", str(cfg), timeout=60)
    finally:
        eagle3("stop", "--all", "--grace", "1", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "extract: pid " in text and "in wait_in_collective (waits_in.py:" in text, text  # py-spy's own frame
    assert "=== stack of pid " in text and "wait_in_collective" in text
    assert "joined the group; waiting in the collective" in text  # the log's end
    kept = text.strip().splitlines()[-1].removeprefix("kept in ")
    assert "forensics" in kept and open(kept).read().startswith("eagle3 why extract")


def test_without_py_spy_one_line_says_why_and_the_rest_is_gathered(tmp_path, monkeypatch):
    from pipeline.config import load_workspace
    from pipeline.controller import Controller
    from pipeline.observe import forensics

    cfg = stage_cfg(tmp_path)
    ctl = Controller(workspace=load_workspace(cfg))
    try:
        ctl.start("extract")
        log = tmp_path / ".eagle3" / "logs" / "extract.log"
        wait_for(lambda: log.exists() and "waiting" in log.read_text(), timeout=30, what="the stage to start")
        monkeypatch.setattr(forensics, "pyspy_binary", lambda: None)
        ev, path = ctl.why("extract")
    finally:
        ctl.stop_all(grace_s=1)
        ctl.close()
    assert "stacks: py-spy is not installed (pip install py-spy, in the service's environment)" in ev.summary
    text = ev.text()
    assert "process(es) of extract" in text and "joined the group" in text and path.exists()


def test_a_stuck_collective_shows_the_waiting_ranks_all_reduce_and_the_sleeping_ranks_frame(tmp_path):
    """A 2-rank gloo torchrun: rank 1 never reaches the all_reduce rank 0 waits in; `eagle3 why train` names
    both frames from py-spy's real output (the launcher, a Python process too, shows its own wait)."""
    import sys

    cfg = tmp_path / "eagle3.toml"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(fixture_argv("collective.py")[-1])]
    cfg.write_text(f'[stages.train]\nout = "ckpt"\nargv = {json.dumps(argv)}\n'
                   'env = { MASTER_ADDR = "127.0.0.1", GLOO_SOCKET_IFNAME = "lo", OMP_NUM_THREADS = "1" }\n')
    assert eagle3("start", "train", "--force", "--config", str(cfg)).returncode == 0
    try:
        log = tmp_path / ".eagle3" / "logs" / "train.log"
        wait_for(lambda: log.exists() and log.read_text().count("ready") >= 2, timeout=60,
                 what="both ranks to join the group")
        # a collective entered a moment ago is a run at work (flight.MOVING_S): ask once rank 0 has waited longer
        time.sleep(flight.MOVING_S + 1)
        out = eagle3("why", "train", "--native", "--config", str(cfg), timeout=60)
    finally:
        eagle3("stop", "--all", "--grace", "1", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    summary = out.stdout.split("\n\n", 1)[0]
    assert "(rank 0) in all_reduce (" in summary and "(rank 1) in slow_rank (collective.py:" in summary, summary
    # the flight recorder each rank dumped on the knock: where each one is, counted by PyTorch
    assert re.search(r"collectives: rank 0 waits in all_reduce #4 for [\d.]+s; rank 1 is at #3 → rank 1 is behind",
                     summary), summary
    # PyTorch's own count in the dump: rank 1 never enqueued #4, rank 0's #4 is in flight. (A loaded machine
    # may dump rank 1 before gloo's worker thread has retired its #3: its "last completed" is not asserted.)
    section = out.stdout.split("=== the flight recorder (PyTorch)", 1)[-1].split("===", 2)[1]
    assert re.search(r"rank 1, process group 0: last enqueued #3, last completed #\d", section), section
    assert re.search(r"rank 0, process group 0: last enqueued #4, last completed #\d", section), section
    assert re.search(r"#4 gloo:all_reduce \w+ sizes \[\[4\]\] in flight", section), section
    # --native: the C/C++ frames under the Python ones (the rank waiting in gloo's wait, in libtorch)
    assert re.search(r"\(lib\w*torch\w*\.so", out.stdout), out.stdout[-3000:]
