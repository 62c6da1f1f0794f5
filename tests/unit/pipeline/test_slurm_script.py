"""The Slurm executor without a cluster: the generated batch script, Slurm's answers parsed, and the
one-line problems of `check-config` (the real cluster is tests/integration/test_slurm.py's)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.config import SlurmConfig, TrainStage, load_workspace
from pipeline.configcheck import problems
from pipeline.stages import slurm


def script(argv: list[str], **stage) -> str:
    return slurm.batch_script(name="eagle3-train-r1-7", argv=argv, stage=TrainStage(argv=argv, executor="slurm", **stage),
                              slurm=SlurmConfig(partition="gpu", account="ml", time="12:00:00", extra_args=["--exclusive"]),
                              log=Path("/srv/ws/.eagle3/logs/train.log"), cwd=Path("/srv/ws"))


def test_one_node_execs_the_stage_with_the_jobs_shape_as_sbatch_lines():
    text = script(["python", "-m", "x", "--out", "a b"], gpus_per_node=8, cpus_per_task=32, mem="512G")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for opt in ("--job-name=eagle3-train-r1-7", "--output=/srv/ws/.eagle3/logs/train.log", "--open-mode=append",
                "--nodes=1", "--gres=gpu:8", "--cpus-per-task=32", "--mem=512G", "--partition=gpu", "--account=ml",
                "--time=12:00:00", "--exclusive", "--chdir=/srv/ws"):
        assert f"#SBATCH {opt}" in lines, opt
    assert "python -m x --out 'a b' &" in lines  # quoted: never a shell string
    assert "#SBATCH --qos" not in text
    # Slurm's warning before the time limit, and the requeue after it (the stage's max_restarts: 3)
    assert "#SBATCH --signal=B:USR1@300" in lines and "#SBATCH --requeue" in lines
    assert "trap eagle3_on_limit USR1" in lines and lines[-1] == 'exit "$eagle3_code"'
    assert '[ "${SLURM_RESTART_COUNT:-0}" -lt 3 ]' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_without_a_requeue_or_a_warning_the_script_says_so():
    text = script(["python", "-m", "x"], requeue=False, limit_signal_s=0)
    assert "#SBATCH --no-requeue" in text and "--signal" not in text and "scontrol requeue" not in text


def test_several_nodes_run_torchrun_under_srun_with_the_rendezvous_from_the_allocation():
    text = script(["torchrun", "--standalone", "--nproc-per-node", "8", "-m", "pipeline.train", "--steps", "9"],
                  nodes=2, gpus_per_node=8)
    assert "#SBATCH --nodes=2" in text and "--standalone" not in text
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    last = next(line for line in text.splitlines() if line.startswith("srun "))
    assert last.startswith("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun ") and last.endswith(" &")
    assert ('--nnodes="$SLURM_NNODES" --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d '
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --nproc-per-node 8 -m pipeline.train --steps 9') in last
    # the script is valid shell
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("text, want", [("0:0", (0, None)), ("3:0", (3, None)), ("0:15", (None, 15)), ("", (None, None))])
def test_slurms_exit_code_field(text, want):
    assert slurm._exit(text) == want


def test_a_job_we_cancelled_is_described_as_stopped_not_failed():
    info = slurm.JobInfo(state="FAILED", reason="JobLaunchFailure", signal=15)
    assert info.describe_stop() == "ended after scancel (signal 15)" and "FAILED" not in info.describe_stop()


def test_an_ended_job_is_described_with_slurms_state_and_reason():
    assert slurm.JobInfo(state="FAILED", reason="NonZeroExitCode", exit_code=3).describe() == (
        "Slurm: FAILED (NonZeroExitCode), exit code 3")
    assert slurm.JobInfo(state="TIMEOUT", reason="TimeLimit", signal=9).describe() == (
        "Slurm: TIMEOUT (TimeLimit), killed by signal 9")


def slurm_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[stages.train]\nexecutor = "slurm"\nargv = ["torchrun", "-m", "pipeline.train"]\n')
    return cfg


def test_without_slurms_commands_check_config_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    found = problems(load_workspace(slurm_config(tmp_path)))
    assert found == ['eagle3.toml: stages.train.executor: "slurm" needs Slurm\'s client commands on this host; not on '
                     'PATH: sbatch, squeue, scontrol, scancel (install slurm-client, or run the stage with executor = '
                     '"local")'], found


def test_an_unreachable_controller_is_one_line(tmp_path, monkeypatch):
    for name in ("sbatch", "squeue", "scancel"):
        (tmp_path / name).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'Slurmctld(primary) at ctl is DOWN'\nexit 1\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    found = problems(load_workspace(slurm_config(tmp_path)))
    assert len(found) == 1 and "the Slurm controller does not answer" in found[0] and "is DOWN" in found[0], found
    assert "check SLURM_CONF and that slurmctld runs" in found[0]


def test_state_on_a_network_filesystem_is_refused(tmp_path, monkeypatch):
    import pipeline.manifest as manifest

    cfg = tmp_path / "eagle3.toml"
    cfg.write_text('[stages.train]\nargv = ["true"]\n')
    monkeypatch.setattr(manifest, "filesystem_type", lambda path: "nfs4")
    found = [p for p in problems(load_workspace(cfg)) if "state.dir" in p]
    assert len(found) == 1 and "is on nfs4, shared across hosts; the store needs a local disk" in found[0]
