"""Stages as Slurm jobs, against a real one-node cluster on this host (tests/slurm/cluster.sh: Debian's
slurm-wlm with four fake GPUs). Skipped, with the reason, where the cluster cannot start (not root)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.controller import Controller
from tests.conftest import (
    FIXTURES,
    ROOT,
    SLURM_BOOTSTRAP,
    TRAIN_SMALL,
    TRAIN_STEPS,
    eagle3,
    fixture_argv,
    shared_dir,
    status_json,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
CONF = "/tmp/eagle3-slurm/slurm.conf"
TWO_NODES_UNAVAILABLE = Path("/tmp/eagle3-slurm/two-nodes.unavailable")
NODES = ("e3n1", "e3n2")  # partition `two`; `spare` (e3n3, e3n4) is the node-death test's alone


@pytest.fixture(scope="session")
def _cluster_up(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster needs root (it installs slurm-wlm and starts slurmctld/slurmd)")
    from filelock import FileLock

    started = os.environ.get(SLURM_BOOTSTRAP)  # conftest started it as the run began: wait for its end
    if started:  # within the first test's timeout: a slow install skips, saying so, rather than fails
        try:
            wait_for(lambda: Path(started).exists(), timeout=180, interval=0.5, what="tests/slurm/cluster.sh up")
        except AssertionError:
            pytest.skip(f"the test Slurm cluster was still starting after 180 s (its output: {started}.log)")
    with FileLock(str(shared_dir(tmp_path_factory, "slurm-cluster.lock"))):
        r = subprocess.run([str(CLUSTER), "up"], capture_output=True, text=True, timeout=600)
    if r.returncode:
        pytest.skip(f"the test Slurm cluster did not start: {r.stderr.strip()[-400:]}")
    return CONF


@pytest.fixture
def cluster(_cluster_up, monkeypatch, tmp_path):
    """SLURM_CONF for this test; every job the test's workspaces submitted, and its blocker, is
    cancelled after it (a failed test leaves nothing holding the cluster's GPUs)."""
    monkeypatch.setenv("SLURM_CONF", _cluster_up)
    tag = uuid.uuid4().hex[:8]
    yield tag
    jobs = []
    for db in tmp_path.glob("**/.eagle3/state.sqlite"):
        conn = sqlite3.connect(db)
        jobs += [r[0] for r in conn.execute("SELECT job_id FROM stage_procs WHERE job_id IS NOT NULL")]
        conn.close()
    subprocess.run(["scancel", "--name", f"blocker-{tag}", *jobs], capture_output=True)


@pytest.fixture
def two_nodes(cluster):
    """The cluster's namespaced nodes: partition `two` (e3n1, e3n2), shared by the tests that only run jobs
    there, and `spare` (e3n3, e3n4), the node-death test's alone."""
    if TWO_NODES_UNAVAILABLE.exists():
        pytest.skip(f"the 2-node Slurm partition is not available here: {TWO_NODES_UNAVAILABLE.read_text().strip()}")
    return cluster


def node_state(node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True).stdout
    m = re.search(r"\bState=(\S+)", out)
    return m.group(1) if m else ""


def serve(cfg: Path) -> subprocess.Popen:
    env = {**os.environ, "SLURM_CONF": CONF}
    return subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def end_serve(svc: subprocess.Popen, cfg: Path) -> str:
    if svc.poll() is None:
        svc.send_signal(signal.SIGTERM)
    out = svc.communicate(timeout=60)[0]
    eagle3("stop", "--all", "--grace", "2", "--config", str(cfg), env={"SLURM_CONF": CONF})
    return out


def events(cfg: Path, kind: str) -> list[dict]:
    conn = sqlite3.connect(cfg.parent / ".eagle3" / "state.sqlite")
    rows = conn.execute("SELECT stage, data FROM events WHERE kind = ? ORDER BY id", (kind,)).fetchall()
    conn.close()
    return [{"stage": stage, **json.loads(data)} for stage, data in rows]


def slurm_ws(tmp_path: Path, stages: dict[str, tuple[list[str], str]], extra: str = "", monitor: str = "") -> Path:
    """A workspace whose stages run as Slurm jobs: {stage: (argv, extra TOML lines)}."""
    parts = [f"[monitor]\ntick_s = 0.5\nfake_gpus = 4\n{monitor}", extra]
    for name, (argv, more) in stages.items():
        parts.append(f'[stages.{name}]\nexecutor = "slurm"\nargv = {json.dumps(argv)}\n{more}\n')
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text("\n".join(parts))
    return cfg


def squeue(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%T"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def job_field(job: str, key: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    m = re.search(rf"\b{key}=(\S*)", out)
    return m.group(1) if m else None


def blocker(tag: str, gpus: int) -> str:
    """A job holding `gpus` of the cluster's four GPUs."""
    out = subprocess.run(["sbatch", "--parsable", f"--job-name=blocker-{tag}", f"--gres=gpu:{gpus}", "--output=/dev/null",
                          "--wrap", "sleep 300"], capture_output=True, text=True, check=True)
    job = out.stdout.strip()
    wait_for(lambda: job_field(job, "JobState") == "RUNNING", timeout=90, what="the blocker to run")
    return job


def test_queued_while_the_gpus_are_held_then_running_then_stopped_by_scancel(cluster, tmp_path):
    # the server wants all four GPUs; one is held (other tests' jobs may hold more, for a while)
    cfg = slurm_ws(tmp_path, {"server": (fixture_argv("sleeper.py"), "gpus_per_node = 4")})
    held = blocker(cluster, gpus=1)
    with Controller.open(str(cfg)) as ctl:
        row = ctl.start("server")
    assert row.state == "queued" and row.job_id, row
    st = wait_for(lambda: (s := status_json(cfg))["stages"]["server"]["reason"] and re.search(
        r"is PENDING \((Resources|Priority)\)", s["stages"]["server"]["reason"]) and s, timeout=30,
        what="Slurm's reason for the wait")
    server = st["stages"]["server"]
    assert server["state"] == "queued" and server["job"] == row.job_id and server["pid"] is None
    assert server["verdict"] == "starting" and not server["stuck"], server
    assert "waiting for its allocation, not a stall" in server["reasons"][0]
    script = (cfg.parent / ".eagle3" / "slurm" / f"{row.job_name}.sh").read_text()
    assert "#SBATCH --gres=gpu:4" in script and "#SBATCH --output=" in script

    subprocess.run(["scancel", held], check=True)
    wait_for(lambda: status_json(cfg)["stages"]["server"]["state"] == "running", timeout=120, what="the job to run")
    log = cfg.parent / ".eagle3" / "logs" / "server.log"  # slurmstepd opens it once the job runs
    wait_for(lambda: log.exists() and "sleeping" in log.read_text(errors="replace"), timeout=30,
             what="the job's output in the stage log")
    assert eagle3("stop", "server", "--grace", "5", "--config", str(cfg), env={"SLURM_CONF": CONF}).returncode == 0
    st = status_json(cfg)["stages"]["server"]
    assert st["state"] == "stopped" and st["verdict"] == "stopped", st
    assert job_field(row.job_id, "JobState") in ("CANCELLED", "FAILED", "COMPLETED")
    assert squeue(row.job_name) and all(not line.endswith(("RUNNING", "PENDING")) for line in squeue(row.job_name))


def test_a_failing_job_is_dead_with_its_exit_code_and_slurms_reason(cluster, tmp_path):
    cfg = slurm_ws(tmp_path, {"extract": (fixture_argv("exit3.py"), "")})
    with Controller.open(str(cfg)) as ctl:
        row = ctl.start("extract")
    st = wait_for(lambda: (s := status_json(cfg)["stages"]["extract"])["state"] == "exited" and s, timeout=60,
                  what="the job to end")
    assert st["exit_code"] == 3 and st["job"] == row.job_id
    assert st["reason"] == "Slurm: FAILED (NonZeroExitCode), exit code 3", st["reason"]
    st = wait_for(lambda: (s := status_json(cfg)["stages"]["extract"])["verdict"] == "dead" and s, timeout=30,
                  what="the verdict")
    assert "exited with code 3; its log says: about to exit 3" in st["reasons"][0], st["reasons"]


def test_a_job_the_cluster_no_longer_knows_is_unknown_never_running(cluster, tmp_path):
    cfg = slurm_ws(tmp_path, {"extract": (fixture_argv("sleeper.py"), "")})
    with Controller.open(str(cfg)) as ctl:
        row = ctl.start("extract")
        ctl.store.update_proc(row.id, job_id="987654")  # an id this cluster never issued
    st = status_json(cfg)["stages"]["extract"]
    assert st["state"] == "unknown" and "no longer knows job 987654" in st["reason"], st
    subprocess.run(["scancel", row.job_id], check=True)


def test_kill_9_of_serve_and_adoption_without_a_resubmission(cluster, tmp_path):
    cfg = slurm_ws(tmp_path, {"train": (fixture_argv("sleeper.py"), "gpus_per_node = 1")})
    env = {**os.environ, "SLURM_CONF": CONF}
    svc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert eagle3("start", "train", "--force", "--config", str(cfg), env={"SLURM_CONF": CONF}).returncode == 0
        job = wait_for(lambda: (s := status_json(cfg)["stages"]["train"])["state"] == "running" and s["job"],
                       timeout=60, what="the job to run")
        os.killpg(svc.pid, signal.SIGKILL)
        svc.wait()
        svc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: status_json(cfg)["monitor"] == "running", timeout=30, what="serve to start again")
        time.sleep(1.5)  # three ticks of the adopting service
        st = status_json(cfg)["stages"]["train"]
        assert st["state"] == "running" and st["job"] == job
        with Controller.open(str(cfg)) as ctl:
            name = ctl.store.latest_proc("train").job_name
        assert len(squeue(name)) == 1, "adopted, never submitted again"

        # Died between recording the job's name and sbatch's answer: the job is found by its name.
        with Controller.open(str(cfg)) as ctl:
            ctl.store.update_proc(ctl.store.latest_proc("train").id, job_id=None)
        wait_for(lambda: status_json(cfg)["stages"]["train"]["job"] == job, timeout=10, what="the job found by name")
        assert len(squeue(name)) == 1
    finally:
        if svc.poll() is None:
            svc.send_signal(signal.SIGTERM)
            svc.wait(timeout=30)
        eagle3("stop", "--all", "--grace", "2", "--config", str(cfg), env={"SLURM_CONF": CONF})


def test_the_toy_pipelines_handoff_with_jobs_submits_training_exactly_once(cluster, tmp_path, request):
    """Server and extraction as jobs on this host; training, handed off by itself, as one job on both nodes of
    partition `two` (where the 2-node partition cannot stand: on this host, with 2 GPUs)."""
    from pipeline.toy.demo_workspace import write_dataset, write_demo_workspace

    two = not TWO_NODES_UNAVAILABLE.exists()
    if two:
        request.getfixturevalue("two_nodes")

    demo = write_demo_workspace(tmp_path / "ws")
    write_dataset(demo.parent / "data.jsonl", 40)
    text = demo.read_text().replace("tick_s = 1\n", "tick_s = 0.5\n").replace("fake_gpus = 2", "fake_gpus = 4")
    text = re.sub(r"(\[stages\.(server|extract)\]\n)", r'\1executor = "slurm"\n', text)
    stand_in = [sys.executable, str(FIXTURES / "fake_train.py"), str(tmp_path / "ws" / "ckpt")]
    shape = 'nodes = 2\nslurm_args = ["--partition=two"]\n' if two else ""
    text = re.sub(r"(\[stages\.train\]\n)argv = \[.*?\]\n", lambda m: m.group(1) + 'executor = "slurm"\ngpus_per_node = 2\n'
                  f"{shape}argv = {json.dumps(stand_in)}\n", text, flags=re.S)
    demo.write_text(text)
    env = {**os.environ, "SLURM_CONF": CONF}
    for args in (["start", "server"], ["start", "extract"], ["autostart", "on"]):
        r = eagle3(*args, "--config", str(demo), env={"SLURM_CONF": CONF})
        assert r.returncode == 0, (args, r.stderr)
    svc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--config", str(demo)], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        st = wait_for(lambda: (s := status_json(demo))["autostart"] in ("training-done", "training-failed", "failed")
                      and s, timeout=180, interval=0.5, what="the handoff to finish training")
    finally:
        svc.send_signal(signal.SIGTERM)
        out = svc.communicate(timeout=60)[0]
        eagle3("stop", "--all", "--grace", "2", "--config", str(demo), env={"SLURM_CONF": CONF})
    assert st["autostart"] == "training-done", (st["autostart_reason"], out[-2000:])
    assert st["stages"]["extract"]["verdict"] == "done" and st["stages"]["server"]["state"] == "stopped"
    assert "the server's Slurm job" in out and "has left the queue" in out, out[-3000:]
    conn = sqlite3.connect(demo.parent / ".eagle3" / "state.sqlite")
    trains = conn.execute("SELECT job_id, job_name FROM stage_procs WHERE stage = 'train'").fetchall()
    conn.close()
    assert len(trains) == 1 and trains[0][0], trains
    launches = (tmp_path / "ws" / "ckpt" / "launches.txt").read_text().splitlines()
    if two:  # once per node, in the one job: srun started it on both
        assert sorted(line.split()[2] for line in launches) == list(NODES), launches
        assert st["stages"]["train"]["nodes"] == "e3n[1-2]", st["stages"]["train"]
    else:
        assert len(launches) == 1
    assert job_field(trains[0][0], "TresPerNode") == "gres:gpu:2"  # submitted with --gres=gpu:2
    assert st["stages"]["train"]["job"] == trains[0][0] and st["stages"]["train"]["exit_code"] == 0


def test_a_remote_stage_stopped_with_sigstop_is_stalled_by_its_nodes_readings(two_nodes, tmp_path):
    """The stage runs on e3n1, another host to the monitor: its processes are read there through `srun --overlap`;
    SIGSTOPped, it is judged stalled from those readings, naming the node, within the usual deadline."""
    from pipeline.observe.probes.remote import job_processes

    out = tmp_path / "out"
    cfg = slurm_ws(tmp_path, {"extract": (fixture_argv("fake_extract.py", str(out), "100000", "0.2"),
                                          f'out = "{out}"\nslurm_args = ["--partition=two", "--nodelist=e3n1"]')},
                   monitor="stall_floor_s = 6\nremote_every_s = 1\n")
    svc = serve(cfg)
    try:
        assert eagle3("start", "extract", "--config", str(cfg), env={"SLURM_CONF": CONF}).returncode == 0
        st = wait_for(lambda: (s := status_json(cfg)["stages"]["extract"])["verdict"] == "progressing" and s,
                      timeout=90, what="the remote extraction to progress", interval=0.5)
        assert st["nodes"] == "e3n1" and st["job"] and st["read"]["via"] == "srun --overlap on e3n1", st
        shown = eagle3("status", "--config", str(cfg), env={"SLURM_CONF": CONF}).stdout
        assert re.search(rf"Slurm job {st['job']} on e3n1 \(read through srun --overlap on e3n1, \d+s old", shown), shown
        with Controller.open(str(cfg)) as ctl:
            obs = ctl.store.latest_observation("extract")
        process = obs["process"]
        assert process["remote"]["via"] == "srun --overlap on e3n1" and process["cpu_s"] > 0, process
        assert process["members"] >= 2 and process["remote"]["nodes"]["e3n1"]["members"] == process["members"]
        assert obs["gpus"] and {g["node"] for g in obs["gpus"]} == {"e3n1"}, obs.get("gpus")  # NVML read there

        procs, _ = job_processes(st["job"], "e3n1")  # this test shares the nodes' process namespace
        assert procs
        for p in procs:
            p.suspend()
        stopped_at = time.time()
        try:
            st = wait_for(lambda: (s := status_json(cfg)["stages"]["extract"])["verdict"] == "stalled" and s,
                          timeout=45, what="the stalled verdict", interval=0.5)
            took = time.time() - stopped_at
            why = eagle3("why", "extract", "--config", str(cfg), env={"SLURM_CONF": CONF})  # its stacks, read there
            logs = eagle3("logs", "extract", "--config", str(cfg), env={"SLURM_CONF": CONF})
        finally:
            for p in procs:
                p.resume()
        reasons = "\n".join(st["reasons"])
        assert f"on e3n1: {len(procs)} of {len(procs)} process(es) stopped" in reasons, reasons
        assert "processes read through srun --overlap on e3n1" in reasons, reasons
        assert took < 6 + 3 * 1 + 10, took  # the deadline (stall_floor_s), a remote reading's age, a tick's slack
        assert why.returncode == 0, why.stderr
        assert re.search(r"stack of pid \d+ on e3n1 \(py-spy dump\)", why.stdout), why.stdout[-3000:]
        assert re.search(r"pid \d+ on e3n1 stopped .*fake_extract\.py", why.stdout), why.stdout[-3000:]
        assert re.search(r"extract: pid \d+ on e3n1 in <module> \(fake_extract\.py:\d+\)", why.stdout), why.stdout
        assert logs.returncode == 0 and "sample " in logs.stdout, logs
        wait_for(lambda: status_json(cfg)["stages"]["extract"]["verdict"] == "progressing", timeout=60,
                 what="the recovery once resumed", interval=0.5)
    finally:
        end_serve(svc, cfg)


def test_a_two_node_training_hits_its_time_limit_requeues_resumes_and_ends_as_an_uninterrupted_run(
        two_nodes, toy_extraction, uninterrupted_training, tmp_path):
    """torchrun under srun on both nodes (c10d rendezvous on the first), with a 1-minute limit: Slurm's warning
    (USR1) makes it checkpoint, the job requeues itself, the channel says so once, and the run resumes from the
    saved step to the same final loss as an uninterrupted run beside it, and exports its draft."""
    data, target = str(toy_extraction["out"]), str(toy_extraction["target"])
    steps = ["--steps", str(TRAIN_STEPS), *TRAIN_SMALL]
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            str(FIXTURES / "slow_train.py"), "--data", data, "--target-model", target, *steps, "--out", str(ckpt)]
    cfg = slurm_ws(tmp_path, {"train": (argv, f'out = "{ckpt}"\nnodes = 2\nlimit_signal_s = 15\nmax_restarts = 3\n'
                                              'slurm_args = ["--partition=two", "--time=1"]\n'
                                              'env = { SLOW_STEP_S = "1.5", OMP_NUM_THREADS = "1", CUDA_VISIBLE_DEVICES = "" }')})
    svc = serve(cfg)
    try:
        r = eagle3("start", "train", "--force", "--config", str(cfg), env={"SLURM_CONF": CONF})  # no extraction here
        assert r.returncode == 0, r.stderr
        st = wait_for(lambda: (s := status_json(cfg)["stages"]["train"])["state"] == "running" and s, timeout=60,
                      what="the 2-node job to run", interval=0.5)
        assert st["nodes"] == "e3n[1-2]", st
        wait_for(lambda: (ckpt / "progress.jsonl").exists() and len(progress_rows(ckpt)) >= 2, timeout=60,
                 what="two steps", interval=0.5)
        why = eagle3("why", "train", "--config", str(cfg), env={"SLURM_CONF": CONF})  # each rank read on its node
        requeued = wait_for(lambda: events(cfg, "stage-requeued"), timeout=120, what="the requeue at the limit",
                            interval=0.5)
        job = requeued[0]["job_id"]  # the same job, requeued by itself (or, had its stop outlasted the limit, a new one)
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], check=True)  # the rest runs whole
        st = wait_for(lambda: (s := status_json(cfg)["stages"]["train"])["state"] == "exited" and s, timeout=180,
                      interval=1, what="the resumed training to end")
    finally:
        out = end_serve(svc, cfg)
    assert why.returncode == 0, why.stderr
    for node in NODES:
        assert re.search(rf"stack of pid \d+ \(rank [01]\) on {node} \(py-spy dump\)", why.stdout), why.stdout[-4000:]
    assert "collectives: " in why.stdout and "rank 0, process group 0: last enqueued #" in why.stdout, why.stdout[-4000:]
    assert st["exit_code"] == 0 and st["job"] == job, (st, out[-3000:])
    # Slurm's warning, the checkpoint, the job requeueing itself: the path taken whenever the stage stops within
    # the warning's time (a stop outlasting it would end TIMEOUT and be submitted again: "resubmitted")
    assert len(requeued) == 1 and requeued[0]["how"] == "requeued" and requeued[0]["attempt"] == 1, requeued
    log = (cfg.parent / ".eagle3" / "logs" / "train.log").read_text()
    m = re.search(r"SIGTERM: checkpoint saved at step (\d+)", log)
    saved = int(m.group(1)) if m else None  # None: the warning came while the ranks were still starting
    assert requeued[0]["resume_step"] == saved and "reached its 1m time limit" in requeued[0]["why"], requeued
    said = [line for line in out.splitlines() if "requeued by Slurm" in line]
    assert len(said) == 1, out[-3000:]
    assert (f"resumes from step {saved}" if saved else "starts again from its beginning") in said[0], said
    assert not [line for line in out.splitlines() if "is dead" in line or "is stalled" in line], out[-3000:]
    rows = progress_rows(ckpt)
    assert [r["step"] for r in rows] == list(range(1, TRAIN_STEPS + 1)), "steps must not repeat or skip across it"
    final = progress_rows(uninterrupted_training["ckpt"])[-1]
    assert rows[-1]["loss"] == pytest.approx(final["loss"], rel=1e-5), (rows[-1], final)
    from pipeline.draft.sglang import check_export
    assert check_export(ckpt / "draft") == []


def progress_rows(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "progress.jsonl").read_text().splitlines() if line.strip()]


def test_a_nodes_death_mid_job_is_node_fail_a_requeue_and_one_message(two_nodes, tmp_path):
    """The node running the stage dies (its slurmd and every process on it): Slurm reports NODE_FAIL, requeues
    the job (--requeue) onto the other node, and the channel is told once."""
    out = tmp_path / "out"
    cfg = slurm_ws(tmp_path, {"extract": (fixture_argv("fake_extract.py", str(out), "100000", "0.2"),
                                          f'out = "{out}"\nslurm_args = ["--partition=spare"]')},
                   monitor="stall_floor_s = 60\nremote_every_s = 2\n")
    svc = serve(cfg)
    dead = None
    try:
        assert eagle3("start", "extract", "--config", str(cfg), env={"SLURM_CONF": CONF}).returncode == 0
        st = wait_for(lambda: (s := status_json(cfg)["stages"]["extract"])["state"] == "running" and s["nodes"]
                      and s, timeout=60, what="the job to run", interval=0.5)
        dead = st["nodes"]
        subprocess.run(["bash", str(CLUSTER), "node-kill", dead], check=True)
        requeued = wait_for(lambda: events(cfg, "stage-requeued"), timeout=90, what="Slurm to requeue the job", interval=0.5)
        st = wait_for(lambda: (s := status_json(cfg)["stages"]["extract"])["state"] == "running" and
                      s["nodes"] not in (None, dead) and s, timeout=120, what="the job to run on the other node", interval=0.5)
    finally:
        out_text = end_serve(svc, cfg)
        if dead:  # back, and idle again, for the next run's test
            subprocess.run(["bash", str(CLUSTER), "node-up", dead], capture_output=True)
            wait_for(lambda: node_state(dead).startswith("IDLE"), timeout=60, what=f"node {dead} back", interval=0.5)
    assert len(requeued) == 1 and requeued[0]["why"].startswith(f"lost node {dead} (DOWN"), requeued
    said = [line for line in out_text.splitlines() if "requeued by Slurm" in line]
    assert len(said) == 1 and f"extract lost node {dead}" in said[0], out_text[-3000:]
    assert not [line for line in out_text.splitlines() if "is dead" in line or "is stalled" in line], out_text[-3000:]


def test_where_srun_cannot_read_the_nodes_sstat_speaks_and_says_so(two_nodes, tmp_path):
    """The nodes cannot be read (here: the probe's interpreter is missing there): CPU time and memory come from
    Slurm's own accounting, named as the source, with srun's reason; never a zero."""
    from pipeline.observe.probes.remote import RemoteProbe
    from pipeline.states import StageProc, StageState

    job = subprocess.run(["sbatch", "--parsable", "--partition=two", "--nodelist=e3n2", "--output=/dev/null",
                          "--wrap", "python3 -c 'while True: pass'"], capture_output=True, text=True, check=True)
    job_id = job.stdout.strip()
    try:
        wait_for(lambda: job_field(job_id, "JobState") == "RUNNING", timeout=60, what="the job to run", interval=0.5)
        row = StageProc(id=1, stage="extract", state=StageState.RUNNING, executor="slurm", job_id=job_id,
                        job_nodes="e3n2")
        reading = wait_for(lambda: (r := RemoteProbe(every_s=1, python="/nonexistent/python").read(row)).value.get(
            "cpu_s") and r, timeout=30, what="sstat to account some CPU", interval=0.5)
        assert reading.value["remote"]["via"] == "sstat (Slurm's accounting)" and reading.value["mem_bytes"] > 0
        assert "`srun --overlap` on e3n2 failed" in reading.unknown and "from sstat" in reading.unknown, reading
        good = RemoteProbe(every_s=1).read(row)  # and the nodes' own reading where srun can run it
        assert good.unknown is None and good.value["remote"]["via"] == "srun --overlap on e3n2", good
    finally:
        subprocess.run(["scancel", job_id])
