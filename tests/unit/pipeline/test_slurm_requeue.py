"""A Slurm job's interruptions without a cluster: Slurm's requeue followed and said once, an interrupted end
submitted again up to the limit, the channel's line, the time-limit warning, the probe's own reading
(the real cluster's drills are tests/integration/test_slurm.py's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from handlers.render.alerts import requeued_text
from pipeline.observe.diagnosis import Diagnoser
from pipeline.observe.probes.remote import combine, job_processes, node_reading
from pipeline.observe.sampler import time_limit_warning
from pipeline.stages import slurm
from pipeline.stages.slurm_executor import SlurmExecutor, interrupted, limit_text
from pipeline.states import StageProc, StageState
from pipeline.store import Store
from tests.conftest import ROOT, wait_for, workspace_of

TRAIN = '[stages.train]\nexecutor = "slurm"\nargv = ["x"]\nout = "ckpt"\nmax_restarts = 2\n'


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@pytest.fixture
def train_ws(tmp_path):
    ws = workspace_of(tmp_path, TRAIN)
    store = Store(ws.store_path)
    yield ws, store
    store.close()


def job_row(store: Store, **values) -> StageProc:
    run = store.current_run() or store.open_run()
    fields = {"run_id": run, "stage": "train", "state": "running", "argv": "[]", "executor": "slurm",
              "job_id": "41", "job_name": "eagle3-train-r-1", "started_at": 990.0, **values}
    return store.proc(store.insert_proc(fields))


def test_slurms_requeue_is_followed_said_once_and_cancelled_past_the_limit(train_ws, monkeypatch):
    ws, store = train_ws
    (ws.root / "ckpt").mkdir()
    (ws.root / "ckpt" / "latest").write_text("step_120\n")
    (ws.root / "ckpt" / "checkpoints" / "step_120").mkdir(parents=True)
    log = ws.log_path("train")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("eagle3: the stage stopped (exit status 0); requeueing job 41, restart 1\n")
    store.add_observation({"t": 995.0, "stage": "train", "progress": {"done": 123, "total": 500, "unit": "steps"}},
                          run_id=store.open_run())
    row = job_row(store, job_limit_s=3600.0, job_nodes="gpu-[1-2]")
    answers = [slurm.JobInfo(state="PENDING", reason="BeginTime", restarts=1)]
    monkeypatch.setattr(slurm, "query", lambda job: answers[0])
    cancelled = []
    monkeypatch.setattr(slurm, "cancel", lambda job, **_: cancelled.append(job))
    ex = SlurmExecutor(workspace=ws, store=store, host=Clock())
    for _ in range(3):  # followed on every tick, said once
        ex.reconcile(store.proc(row.id))
    (event,) = store.events(kind="stage-requeued")
    d = event["data"]
    assert (d["why"], d["how"], d["attempt"], d["limit"], d["done"], d["resume_step"]) == (
        "reached its 1h time limit", "requeued", 1, 2, 123, 120)
    assert store.proc(row.id).state == StageState.QUEUED and "BeginTime, requeued 1×" in store.proc(row.id).reason
    assert requeued_text("train", d) == (":repeat: train reached its 1h time limit at step 123; requeued by Slurm "
                                         "(job 41) (restart 1 of 2), resumes from step 120")
    answers[0] = slurm.JobInfo(state="PENDING", reason="BeginTime", restarts=3)  # a node failing over and over
    ex.reconcile(store.proc(row.id))
    assert cancelled == ["41"] and store.proc(row.id).restart_given_up
    (limit,) = store.events(kind="restart-limit")
    assert "job 41 3 times, past max_restarts = 2" in limit["data"]["reason"]
    assert "was requeued by Slurm (a preemption" in limit["data"]["reason"]  # no limit line for restart 3, no node down


def test_an_interrupted_end_is_submitted_again_at_once_up_to_the_limit(train_ws):
    from pipeline.automation import Automation

    ws, store = train_ws
    auto = Automation(ws=ws, store=store, clock=lambda: 1000.0)
    started = []

    def start(stage, *, restart_count=0, **_):
        started.append(restart_count)
        return job_row(store, state="exited", job_state="TIMEOUT", job_id=str(50 + restart_count), ended_at=1000.0,
                       restart_count=restart_count, job_limit_s=14400.0)

    auto.sup.start = start
    job_row(store, state="exited", job_state="TIMEOUT", exit_code=None, signal=9, ended_at=1000.0, job_limit_s=14400.0)
    auto.restart_policy()  # restart = "never": an interruption is not the stage's failure
    assert started == [1]
    (event,) = store.events(kind="stage-requeued")
    assert event["data"]["how"] == "resubmitted" and event["data"]["job_id"] == "51"
    assert requeued_text("train", event["data"]).startswith(":repeat: train reached its 4h time limit; requeued "
                                                            "as job 51 (restart 1 of 2), starts again from")
    auto.restart_policy()
    auto.restart_policy()  # at the limit: given up, said once
    assert started == [1, 2]
    assert [e["kind"] for e in store.events(kind="restart-limit")] == ["restart-limit"]


@pytest.mark.parametrize("row, want", [
    ({"job_state": "TIMEOUT", "job_limit_s": 60.0}, "reached its 1m time limit"),
    ({"job_state": "PREEMPTED"}, "was preempted"),
    ({"job_state": "NODE_FAIL", "job_nodes": "gpu-7"}, "lost its node gpu-7 (NODE_FAIL)"),
    ({"job_state": "NODE_FAIL", "job_nodes": "gpu-[7-8]"}, "lost one of its nodes gpu-[7-8] (NODE_FAIL)"),
    ({"job_state": "FAILED", "exit_code": slurm.LIMIT_EXIT, "job_limit_s": 5400.0},
     "stopped at the warning before its 1h30m time limit"),
    ({"job_state": "FAILED", "exit_code": 1}, None),
    ({"job_state": "TIMEOUT", "stop_requested": 1}, None),  # stopped by the operator: not an interruption
])
def test_what_counts_as_an_interruption(train_ws, row, want):
    ws, store = train_ws
    assert interrupted(ws, job_row(store, state="exited", ended_at=1000.0, **row)) == want


def test_no_requeue_means_an_interrupted_end_is_the_stages_end(tmp_path):
    ws = workspace_of(tmp_path, TRAIN + "requeue = false\n")
    store = Store(ws.store_path)
    try:
        assert interrupted(ws, job_row(store, state="exited", job_state="TIMEOUT", ended_at=1000.0)) is None
    finally:
        store.close()


def test_an_interrupted_job_is_stopped_not_dead_so_no_alert_is_raised():
    d = Diagnoser(stage="train")
    d.feed({"t": 0.0, "stage": "train", "process": {"alive": True}, "progress": {"done": 1, "total": 9}})
    v = d.feed({"t": 10.0, "stage": "train", "process": {"alive": False, "exit_code": -9,
                                                           "interrupted": "reached its 1m time limit"}})
    assert v.verdict == "stopped" and "submitted again" in v.reasons[0]


def test_a_requeued_jobs_wait_and_start_again_are_no_stall():
    """Progress, then Slurm requeues the job (queued for two minutes, its hold), then it runs again and starts up:
    no stall is called for the wait, and the wait is not learned as a gap between progress."""
    d = Diagnoser(stage="train")
    for t in range(0, 61, 5):
        d.feed({"t": float(t), "stage": "train", "process": {"alive": True}, "progress": {"done": t, "total": 999}})
    for t in range(65, 186, 5):
        assert d.feed({"t": float(t), "stage": "train", "process": {"alive": True, "queued": True},
                       "progress": {"done": 60, "total": 999}}).verdict == "starting"
    v = d.feed({"t": 215.0, "stage": "train", "process": {"alive": True}, "progress": {"done": 60, "total": 999}})
    assert v.verdict == "starting", v
    v = d.feed({"t": 220.0, "stage": "train", "process": {"alive": True}, "progress": {"done": 61, "total": 999}})
    assert v.verdict == "progressing" and max(d.gaps) <= 5.0, (v, d.gaps)


def test_the_time_limit_warning_at_a_tenth_left_when_the_eta_is_past_it():
    row = StageProc(id=1, stage="train", state=StageState.RUNNING, executor="slurm", job_id="8", job_limit_s=3600.0,
                    job_end_at=10_000.0)
    assert time_limit_warning(row, 1500.0, now=9_000.0, requeue=True) is None  # 1,000 s left: more than a tenth
    assert time_limit_warning(row, 200.0, now=9_700.0, requeue=True) is None  # it ends in time
    text = time_limit_warning(row, 1500.0, now=9_700.0, requeue=True)
    assert text == ("train has 5m00s of its 1h time limit left (Slurm job 8) and needs about 25m00s more: Slurm's "
                    "warning will stop it with a checkpoint and the job is requeued, resuming from it")
    assert "scontrol update JobId=8" in time_limit_warning(row, 1500.0, now=9_700.0, requeue=False)
    assert limit_text(None) == "its time limit"


def test_the_probe_reads_a_jobs_processes_by_their_environment_and_leaves_itself_out(tmp_path, monkeypatch):
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    env = {**os.environ, "SLURM_JOB_ID": "77123", "SLURMD_NODENAME": "nodeA"}
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        procs, _ = job_processes("77123", "nodeA")
        assert [p.pid for p in procs] == [member.pid]
        assert job_processes("77123", "nodeB")[0] == []
        out = subprocess.run([sys.executable, "-m", "bot.cli", "probe", "--json", "--job", "77123", "--files",
                              str(tmp_path), "--fake-gpus", "2"], cwd=ROOT, capture_output=True, text=True,
                             env={**env, "EAGLE3_PROBE": "1"}, timeout=60)
        line = json.loads(out.stdout)
        assert line["node"] == "nodeA" and line["members"] == 1 and line["stopped"] == 0 and line["cpu_s"] >= 0
        assert line["files"]["count"] == 1 and [g["node"] for g in line["gpus"]] == ["nodeA", "nodeA"]
        member.send_signal(signal.SIGSTOP)
        monkeypatch.setenv("SLURMD_NODENAME", "nodeA")  # as on the node, in the probe's own step
        wait_for(lambda: node_reading("77123")["stopped"] == 1, timeout=10, what="the stopped member counted")
        member.send_signal(signal.SIGCONT)
    finally:
        member.kill()
        member.wait()


def test_node_readings_combine_into_one_process_section():
    value = combine([{"node": "a", "members": 3, "cpu_s": 1.5, "io_write_bytes": 10, "stopped": 1, "gpus": [{"index": 0}]},
                     {"node": "b", "members": 2, "cpu_s": 2.0, "io_write_bytes": None, "disk_wait": 1}])
    assert (value["members"], value["cpu_s"], value["io_write_bytes"], value["stopped"], value["disk_wait"]) == (
        5, 3.5, None, 1, 1)  # one node's bytes unknown: the total is unknown, never a part shown as all
    assert set(value["remote_nodes"]) == {"a", "b"} and value["remote_gpus"] == [{"index": 0}]


def test_sstats_figures_are_added_up_over_the_jobs_steps(monkeypatch):
    out = ("41.batch|cpu=00:01:03,energy=0,fs/disk=1690063,mem=14796K,pages=4,vmem=19156K\n"
           "41.0|cpu=1-00:00:01.500,mem=2G,gres/gpuutil=180,gres/gpumem=3G\n")
    monkeypatch.setattr(slurm, "_run", lambda argv, **_: subprocess.CompletedProcess(argv, 0, out, ""))
    assert slurm.sstat("41") == {"cpu_s": 63 + 86401.5, "mem_bytes": 14796 * 1024 + 2 * 2**30, "steps": 2,
                                 "gpu_util": 180.0, "gpu_mem_bytes": 3 * 2**30}
    monkeypatch.setattr(slurm, "_run", lambda argv, **_: subprocess.CompletedProcess(argv, 0, "", ""))
    assert "no step accounted (JobAcctGatherType)" in slurm.sstat("41")


def test_a_directory_this_host_cannot_read_is_counted_as_the_jobs_node_counts_it():
    from pipeline.observe.sampler import _node_files

    process = {"remote": {"nodes": {"gpu-1": {"files": {"count": 7, "bytes": 70}}, "gpu-2": {"members": 1}}}}
    assert _node_files(process, "gpu-1") == {"count": 7, "bytes": 70}
    assert _node_files(process, "gpu-2") is None and _node_files(process, None) is None and _node_files(None, "x") is None


def test_logs_of_a_remote_job_wait_on_the_cluster_only_when_the_cli_asks(train_ws, monkeypatch):
    """`/eagle3 logs` (Slack's 3 s) reads this host's copy; `eagle3 logs` reads the node's through srun."""
    import pipeline.controller as controller_module
    from pipeline.controller import Controller

    ws, store = train_ws
    job_row(store, job_host="gpu-9", log=str(ws.log_path("train")))
    ws.log_path("train").parent.mkdir(parents=True, exist_ok=True)
    ws.log_path("train").write_text("here\n")
    asked = []
    monkeypatch.setattr(controller_module, "run_on_nodes",
                        lambda job, node, args, **_: asked.append(node) or [{"node": node, "lines": ["there"]}])
    ctl = Controller(workspace=ws, store=store)
    assert ctl.logs("train")[1] == ["here"] and asked == []
    assert ctl.logs("train", on_node=True)[1] == ["there"] and asked == ["gpu-9"]
