"""Real subprocesses: start, exit codes, re-adoption, stop escalation, rotation, CLI errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.config import load_workspace
from pipeline.controller import Controller
from tests.conftest import eagle3, fixture_argv, status_json, wait_for

pytestmark = pytest.mark.timeout(90)


def status(cfg):
    return status_json(cfg, cli=True)  # the stage lifecycle as the CLI reports it


def stage_state(cfg, stage):
    return status(cfg)["stages"][stage]


def group_alive(pgid: int) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.info["pid"]) == pgid:
                found.append(p.info["pid"])
        except OSError:
            continue
    return found


@pytest.fixture
def cleanup():
    """Kill any process group a test leaves behind, even when it fails."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def test_exit_code_is_recorded(make_workspace):
    cfg = make_workspace({"extract": fixture_argv("exit3.py")})
    started = eagle3("start", "extract", "--config", str(cfg))
    assert started.returncode == 0, started.stderr
    st = wait_for(lambda: (s := stage_state(cfg, "extract"))["state"] == "exited" and s, what="extract to exit")
    assert st["exit_code"] == 3 and st["ended_at"] >= st["started_at"]
    logs = eagle3("logs", "extract", "--config", str(cfg))
    assert "about to exit 3" in logs.stdout


def test_status_shape_contract(make_workspace):
    cfg = make_workspace({})
    st = status(cfg)
    assert st["run"] is None
    assert set(st["stages"]) == {"server", "extract", "train"}
    for stage in st["stages"].values():
        assert stage["state"] == "not-started"
        assert {"state", "pid", "exit_code", "started_at", "ended_at", "log"} <= set(stage)


def test_service_killed_stage_survives_and_is_readopted(make_workspace, cleanup):
    cfg = make_workspace({"extract": fixture_argv("sleeper.py")})
    # A stand-in for `eagle3 serve`: a long-lived process holding the controller.
    service = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom pipeline.controller import Controller\n"
        f"c = Controller.open({str(cfg)!r})\nprint(c.start('extract').pid, flush=True)\ntime.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    pid = int(service.stdout.readline())
    cleanup.append(pid)
    service.kill()  # kill -9 of the service
    service.wait()
    assert psutil.pid_exists(pid)
    st = stage_state(cfg, "extract")
    assert (st["state"], st["pid"]) == ("running", pid)
    ctl = Controller(workspace=load_workspace(cfg))
    assert ctl.supervisor.is_running("extract")
    result = ctl.stop("extract", grace_s=5)
    ctl.close()
    assert not result.escalated and not result.survivors
    assert stage_state(cfg, "extract")["state"] == "stopped"


def test_runner_killed_stage_keeps_running_then_unknown_when_it_ends(make_workspace, cleanup):
    cfg = make_workspace({"extract": fixture_argv("sleeper.py")})
    assert eagle3("start", "extract", "--config", str(cfg)).returncode == 0
    ctl = Controller(workspace=load_workspace(cfg))
    proc = ctl.store.latest_proc("extract")
    cleanup.append(proc.pgid)
    # The stage writes to its runner through a pipe: a write after the runner died fails and ends it (a known
    # limit, docs/operator.md). The sleeper writes one line at its start, then nothing: kill the runner after it.
    wait_for(lambda: "sleeping" in Path(proc.log).read_text(), what="the stage's first line")
    os.kill(proc.runner_pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(proc.runner_pid) or
             psutil.Process(proc.runner_pid).status() == psutil.STATUS_ZOMBIE, what="runner to die")
    assert stage_state(cfg, "extract")["state"] == "running"  # verified by (pid, create_time)
    os.kill(proc.pid, signal.SIGKILL)
    st = wait_for(lambda: (s := stage_state(cfg, "extract"))["state"] != "running" and s, what="status to notice")
    assert st["state"] == "unknown" and "exit status unknown" in st["reason"]
    ctl.close()


def test_reused_pid_is_not_mistaken_for_the_stage(make_workspace, cleanup):
    cfg = make_workspace({"extract": fixture_argv("sleeper.py")})
    ctl = Controller(workspace=load_workspace(cfg))
    ctl.start("extract")
    proc = ctl.store.latest_proc("extract")
    cleanup.append(proc.pgid)
    time.sleep(0.05)  # at least a few clock ticks, as any real reuse is
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    cleanup.append(stranger.pid)
    # Rewrite history: the row now claims the stranger's pid with the stage's create_time,
    # exactly what a reused pid looks like after a reboot or a long outage.
    os.killpg(proc.pgid, signal.SIGKILL)
    wait_for(lambda: ctl.store.proc(proc.id).state != "running", what="runner to record the kill")
    new_id = ctl.store.insert_proc({**{k: getattr(proc, k) for k in ("run_id", "stage", "argv", "log", "started_at",
                                                                      "create_time")},
                                    "state": "running", "pid": stranger.pid, "pgid": stranger.pid, "stop_requested": 0})
    st = stage_state(cfg, "extract")
    assert st["state"] == "unknown"
    result = ctl.stop("extract", grace_s=1)
    assert "belongs to another process" in result.note
    assert stranger.poll() is None, "a process we could not verify was killed"
    assert ctl.store.proc(new_id).state == "stopped"
    ctl.close()
    stranger.kill()
    stranger.wait()


def test_stop_escalates_and_reaches_grandchildren(make_workspace, cleanup):
    cfg = make_workspace({"server": fixture_argv("fork_grandchild.py"), "extract": fixture_argv("ignore_term.py")})
    for stage in ("server", "extract"):
        assert eagle3("start", stage, "--config", str(cfg)).returncode == 0
    ctl = Controller(workspace=load_workspace(cfg))
    pgids = {s: ctl.store.latest_proc(s).pgid for s in ("server", "extract")}
    cleanup.extend(pgids.values())
    wait_for(lambda: len(group_alive(pgids["server"])) == 2, what="grandchild to fork")
    # a SIGTERM that came before the fixture ignores it would end it at once (seen once, on a busy machine)
    log = Path(ctl.store.latest_proc("extract").log)
    wait_for(lambda: log.exists() and "ignoring SIGTERM" in log.read_text(), what="extract to ignore SIGTERM")
    ctl.close()
    t0 = time.monotonic()
    out = eagle3("stop", "--all", "--grace", "1", "--config", str(cfg))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "server: stopped (SIGKILL needed" in out.stdout
    assert "extract: stopped (SIGKILL needed" in out.stdout
    assert time.monotonic() - t0 < 30
    for pgid in pgids.values():
        assert group_alive(pgid) == []
    st = status(cfg)
    assert st["run"] is None
    # The server's leader obeys SIGTERM; its grandchild is what needed SIGKILL.
    assert (st["stages"]["server"]["state"], st["stages"]["server"]["signal"]) == ("stopped", signal.SIGTERM)
    assert (st["stages"]["extract"]["state"], st["stages"]["extract"]["signal"]) == ("stopped", signal.SIGKILL)


def test_log_rotation_through_runner(make_workspace):
    cfg = make_workspace({"extract": fixture_argv("spew.py", "5000")},
                         extra="[state]\nlog_max_bytes = 50000\nlog_keep = 2\n")
    assert eagle3("start", "extract", "--config", str(cfg)).returncode == 0
    wait_for(lambda: stage_state(cfg, "extract")["state"] == "exited", what="spew to finish")
    logs = sorted(p.name for p in (cfg.parent / ".eagle3" / "logs").iterdir())
    assert logs == ["extract.log", "extract.log.1", "extract.log.2"]
    tail = eagle3("logs", "extract", "-n", "1", "--config", str(cfg)).stdout
    assert "spew line 004999" in tail


def test_missing_program_is_reported(make_workspace):
    cfg = make_workspace({"extract": ["/nonexistent/program"]})
    out = eagle3("start", "extract", "--config", str(cfg))
    assert out.returncode == 2
    assert "extract did not start: cannot start" in out.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_flag_before_or_after_subcommand(make_workspace, where):
    cfg = make_workspace({})
    args = ["--config", str(cfg), "status"] if where == "before" else ["status", "--config", str(cfg)]
    out = eagle3(*args)
    assert out.returncode == 0 and "run: none open" in out.stdout


def test_env_config_lookup(make_workspace):
    cfg = make_workspace({})
    out = eagle3("status", env={"EAGLE3_CONFIG": str(cfg)})
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(("text", "message"), [
    ('[stages.train]\ngpus = "0-3"\n',
     'eagle3: eagle3.toml: stages.train.gpus: expected a list of GPU indices such as [0, 1, 2, 3], got "0-3"\n'),
    ("[stages\n", "eagle3: eagle3.toml: not valid TOML"),
])
def test_bad_config_exits_2_with_one_line(tmp_path, text, message):
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text(text)
    for args in (["status"], ["check-config", str(cfg)], ["start", "train"]):
        out = eagle3(*args, "--config", str(cfg))
        assert out.returncode == 2
        assert out.stderr.startswith(message) and out.stderr.count("\n") == 1
        assert out.stdout == ""
    assert not (tmp_path / ".eagle3").exists(), "a failed command must leave no state behind"


def test_init_never_overwrites_and_status_works_on_the_unedited_template(tmp_path):
    assert eagle3("init", str(tmp_path)).returncode == 0
    cfg = tmp_path / "eagle3.toml"
    before = cfg.read_text()
    again = eagle3("init", str(tmp_path))
    assert again.returncode == 2 and "already exists" in again.stderr
    assert cfg.read_text() == before
    checked = eagle3("check-config", str(cfg))
    assert checked.returncode == 2 and "still holds the placeholder <MODEL_PATH>" in checked.stderr
    assert eagle3("status", "--config", str(cfg)).returncode == 0
    refused = eagle3("start", "server", "--config", str(cfg))
    assert refused.returncode == 2
    assert "stages.server.argv still holds the placeholder <SGLANG_VENV>" in refused.stderr


def test_help_lists_commands():
    out = eagle3("--help")
    for name in ("init", "start", "stop", "status", "logs", "check-config", "run-stage"):
        assert name in out.stdout


def test_train_is_guarded_but_force_supervises_it_like_any_stage(make_workspace):
    cfg = make_workspace({"train": fixture_argv("exit3.py")})
    refused = eagle3("start", "train", "--config", str(cfg))
    assert refused.returncode == 2 and "refusing to start training: no run is open" in refused.stderr
    assert eagle3("start", "train", "--force", "--config", str(cfg)).returncode == 0
    st = wait_for(lambda: (s := stage_state(cfg, "train"))["state"] == "exited" and s, what="train to exit")
    assert st["exit_code"] == 3
    assert status(cfg)["run"] == st["run"], "a failed training keeps its run open: a restart resumes in it"


def test_a_launchers_worker_in_a_session_of_its_own_is_the_stages_and_is_stopped(make_workspace, cleanup):
    """torchrun starts its ranks with start_new_session=True: out of the stage's group and session. They are the
    stage's still — counted by the probes, read by `eagle3 why`, and stopped: a rank that ignores SIGTERM gets the
    escalation's SIGKILL instead of outliving its killed launcher with the GPUs."""
    import psutil

    from pipeline.stages.host import stage_processes

    cfg = make_workspace({"extract": fixture_argv("new_session_worker.py")})
    assert eagle3("start", "extract", "--config", str(cfg)).returncode == 0
    ctl = Controller(workspace=load_workspace(cfg))
    proc = ctl.store.latest_proc("extract")
    cleanup.append(proc.pgid)
    log = Path(proc.log)
    wait_for(lambda: log.exists() and "ignoring SIGTERM" in log.read_text(), what="the worker to ignore SIGTERM")
    worker = int(log.read_text().split("worker pid ", 1)[1].split()[0])
    assert os.getsid(worker) != proc.pgid and worker in [p.pid for p, _, _ in stage_processes(proc.pgid,
                                                                                             proc.create_time)]
    result = ctl.stop("extract", grace_s=1)
    ctl.close()
    assert result.escalated and not result.survivors
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
