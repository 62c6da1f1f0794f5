"""Stages as Slurm jobs: the batch script, `sbatch --parsable`, the job's state, `scancel`.

Slurm is driven through its own commands (the ones its users already have), never a
scheduler of ours. A job is named before it is submitted and its row records the name
first, so after a crash between the submission and the record the job is found by its
name instead of being submitted again. Reads never raise: a cluster that does not answer,
or no longer knows a job, is a `JobInfo` that says so.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import SlurmConfig, SlurmSettings, StageConfig

SLURM_TIMEOUT_S = 30.0
PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD"})
ACTIVE = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "STAGE_OUT", "RESIZING", "SIGNALING"})
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
TORCHRUN = ("torchrun", "torch.distributed.run")
# Ends that are not the stage's: the job is requeued or submitted again and resumes from its checkpoint
INTERRUPTED = frozenset({"TIMEOUT", "PREEMPTED", "NODE_FAIL"})
# The batch script's exit status when the stage stopped at Slurm's time-limit warning and the job was not requeued
LIMIT_EXIT = 75
LIMIT_MARK = "eagle3: Slurm's warning before the job's time limit"  # a line of the stage's log
REQUEUE_LINE = "requeueing job {job}, restart {restart}"  # the script's line when it requeues itself (the executor reads it)


class SlurmError(Exception):
    """A Slurm command failed; the message is one line naming the command and its answer."""


@dataclass(frozen=True)
class JobInfo:
    """What the cluster says about one job. `state` is Slurm's JobState, or "" when unknown."""

    state: str
    reason: str | None = None  # Slurm's Reason (Resources, Priority, NonZeroExitCode, …) or why unknown
    exit_code: int | None = None
    signal: int | None = None
    known: bool = True  # False: the cluster no longer knows the job (or did not answer)
    host: str | None = None  # the node running the batch script, once it runs
    nodes: str | None = None  # Slurm's NodeList ("gpu-[017-018]"), once it runs
    restarts: int = 0  # how often Slurm requeued it (its Restarts)
    limit_s: float | None = None  # its time limit (None: unlimited or unknown)
    end_at: float | None = None  # when its time limit ends it (EndTime), while it runs

    @property
    def pending(self) -> bool:
        return self.state in PENDING

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        """The end as one phrase: `Slurm: FAILED (NonZeroExitCode), exit code 3`."""
        how = f"Slurm: {self.state}" + (f" ({self.reason})" if self.reason and self.reason != "None" else "")
        if self.signal:
            return f"{how}, killed by signal {self.signal}"
        return f"{how}, exit code {self.exit_code}" if self.exit_code is not None else how

    def describe_stop(self) -> str:
        """The end of a job we cancelled: Slurm's FAILED or CANCELLED for it is the stop, not a failure."""
        how = (f"signal {self.signal}" if self.signal else
               f"exit code {self.exit_code}" if self.exit_code is not None else "no exit status")
        return f"ended after scancel ({how})"


def missing_commands() -> list[str]:
    """The Slurm client commands not on PATH (sbatch, squeue, scontrol, scancel)."""
    return [c for c in ("sbatch", "squeue", "scontrol", "scancel") if shutil.which(c) is None]


def _run(argv: list[str], *, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, env=env)
    except FileNotFoundError:
        raise SlurmError(f"`{argv[0]}` is not on PATH: install Slurm's client commands on this host") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv[:2])}` did not answer within {SLURM_TIMEOUT_S:.0f} s "
                         "(is slurmctld reachable?)") from None
    except OSError as exc:
        raise SlurmError(f"cannot run `{argv[0]}`: {exc.strerror}") from None


def duration_s(text: str | None) -> float | None:
    """Slurm's [days-]hours:minutes:seconds[.fraction] (or minutes:seconds) as seconds; None for UNLIMITED or
    unreadable (TimeLimit=1-02:03:04, sstat's cpu=01:02.500)."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", (text or "").strip())
    if not m:
        return None
    days, hours, minutes = (int(g or 0) for g in m.groups()[:3])
    return ((days * 24 + hours) * 60 + minutes) * 60 + float(m.group(4))


def _epoch(text: str | None) -> float | None:
    """Slurm's local ISO time (EndTime=2026-12-06T06:40:32) as epoch seconds."""
    from datetime import datetime

    try:
        return datetime.strptime((text or "").strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def ping() -> str | None:
    """None when slurmctld answers, else one line saying why not."""
    try:
        r = _run(["scontrol", "ping"])
    except SlurmError as exc:
        return str(exc)
    if r.returncode != 0 or " is UP" not in r.stdout:
        return f"the Slurm controller does not answer (`scontrol ping`: {_first_line(r.stdout + r.stderr) or r.returncode})"
    return None


def _exit(text: str | None) -> tuple[int | None, int | None]:
    """Slurm's ExitCode `code:signal`."""
    m = re.fullmatch(r"(\d+):(\d+)", (text or "").strip())
    if not m:
        return None, None
    code, sig = int(m.group(1)), int(m.group(2))
    return (None, sig) if sig else (code, None)


def query(job_id: str) -> JobInfo:
    """The job's state: `scontrol show job` (running and recently ended jobs), then `sacct` where
    accounting is configured. Never raises."""
    try:
        r = _run(["scontrol", "show", "job", "-o", job_id])
    except SlurmError as exc:
        return JobInfo(state="", reason=str(exc), known=False)
    if r.returncode == 0 and "JobState=" in r.stdout:
        fields = dict(re.findall(r"(\w+)=(\S*)", r.stdout))
        code, sig = _exit(fields.get("ExitCode"))
        host, nodes = fields.get("BatchHost"), fields.get("NodeList")
        reason = fields.get("Reason")  # scontrol writes "Reason=None" for a job with no reason to wait
        state = fields.get("JobState", "")
        return JobInfo(state=state, reason=None if reason in (None, "", "None") else reason,
                       exit_code=code, signal=sig, host=host if host and host != "(null)" else None,
                       nodes=nodes if nodes and nodes != "(null)" else None,
                       restarts=int(fields.get("Restarts") or 0) if (fields.get("Restarts") or "").isdigit() else 0,
                       limit_s=duration_s(fields.get("TimeLimit")),
                       end_at=_epoch(fields.get("EndTime")) if state in ACTIVE else None)
    why = _first_line(r.stderr) or "no answer"
    try:
        a = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Reason"])
    except SlurmError:
        a = None
    if a is not None and a.returncode == 0 and a.stdout.strip():
        state, exit_text, reason = (_first_line(a.stdout).split("|") + ["", ""])[:3]
        code, sig = _exit(exit_text)
        return JobInfo(state=state.split()[0], reason=reason or None, exit_code=code, signal=sig)
    return JobInfo(state="", reason=f"the cluster no longer knows job {job_id} ({why})", known=False)


def find(name: str) -> list[str]:
    """Ids of live (pending or running) jobs named `name`; raises SlurmError when squeue cannot answer."""
    r = _run(["squeue", "-h", "-n", name, "-o", "%i"])
    if r.returncode != 0:
        raise SlurmError(f"squeue: {_first_line(r.stderr) or r.returncode}")
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


def submit(script: Path, *, env: dict[str, str]) -> str:
    """`sbatch --parsable SCRIPT`: the job id."""
    r = _run(["sbatch", "--parsable", str(script)], env=env)
    if r.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {_first_line(r.stderr) or r.returncode}")
    job = _first_line(r.stdout).split(";")[0]  # "id" or "id;cluster"
    if not job.isdigit():
        raise SlurmError(f"sbatch answered {job!r}, not a job id")
    return job


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _tres_number(key: str, text: str) -> float | None:
    """One TRES figure of sstat's TresUsageInTot: cpu as seconds ("1-02:03:04", "00:00:03", "01:02.500"), memory
    as bytes ("14796K"), the rest as numbers."""
    if key == "cpu":
        return duration_s(text)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def sstat(job_id: str) -> dict | str:
    """Slurm's own accounting of a running job (`sstat`, where the cluster gathers it: JobAcctGatherType): its
    steps' CPU time and memory added up, and GPU utilisation and memory where the cluster tracks them; else why
    not. Never raises."""
    try:
        r = _run(["sstat", "-a", "-n", "-P", "-j", job_id, "-o", "JobID,TresUsageInTot"])
    except SlurmError as exc:
        return str(exc)
    totals: dict[str, float] = {}
    steps = 0
    for line in r.stdout.splitlines():
        _, _, tres = line.partition("|")
        if not tres.strip():
            continue
        steps += 1
        for key, _, value in (item.partition("=") for item in tres.split(",")):
            number = _tres_number(key, value)
            if number is not None:
                totals[key] = totals.get(key, 0.0) + number
    if r.returncode != 0 or not steps:
        return f"sstat has no figures for job {job_id}: {_first_line(r.stderr) or 'no step accounted (JobAcctGatherType)'}"
    out: dict = {"cpu_s": round(totals.get("cpu", 0.0), 3), "mem_bytes": int(totals.get("mem", 0)), "steps": steps}
    if "gres/gpuutil" in totals:
        out["gpu_util"] = totals["gres/gpuutil"]
    if "gres/gpumem" in totals:
        out["gpu_mem_bytes"] = int(totals["gres/gpumem"])
    return out


def node_state(node: str) -> str | None:
    """A node's state and Slurm's reason for it ("DOWN+NOT_RESPONDING (Not responding)"); None if unknown."""
    try:
        r = _run(["scontrol", "show", "node", "-o", node])
    except SlurmError:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", r.stdout))
    if r.returncode or "State" not in fields:
        return None
    why = re.search(r"\bReason=(.*?)(?: \[|$)", r.stdout)
    return fields["State"] + (f" ({why.group(1).strip()})" if why and why.group(1).strip() else "")


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list expanded (`scontrol show hostnames`); [] when it cannot be read."""
    try:
        r = _run(["scontrol", "show", "hostnames", nodelist])
    except SlurmError:
        return []
    return [line.strip() for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []


def cancel(job_id: str, *, signal: str | None = None) -> None:
    """`scancel` (with `--signal=SIG --full`: the batch script as well as its steps). Never raises."""
    argv = ["scancel", job_id] if signal is None else ["scancel", f"--signal={signal}", "--full", job_id]
    try:
        _run(argv)
    except SlurmError:
        pass


def job_name(run_id: str, stage: str, proc_id: int) -> str:
    """The name a stage's job is submitted under: unique per start, found again after a crash."""
    return f"eagle3-{stage}-{run_id}-{proc_id}"


def _command(argv: list[str], cfg: SlurmSettings) -> tuple[str, str]:
    """(lines before it, the script's command): argv on one node; on several, `srun` starts argv once per
    node, with torchrun's rendezvous taken from the allocation (c10d on the first node, the job id as its id)."""
    if cfg.nodes == 1:
        return "", shlex.join(argv)
    i = next((k for k, a in enumerate(argv) if a.endswith(TORCHRUN[0]) or a == TORCHRUN[1]), None)
    if i is None:
        return "", f"srun --nodes={cfg.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 " + shlex.join(argv)
    head, rest = argv[: i + 1], [a for a in argv[i + 1:] if a != "--standalone"]
    rdzv = ('--nnodes="$SLURM_NNODES" --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d '
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"')
    return ('MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            "MASTER_PORT=${MASTER_PORT:-29500}\n",
            f"srun --nodes={cfg.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
            f"{shlex.join(head)} {rdzv} {shlex.join(rest)}")


def _wrapped(command: str, *, requeue_below: int | None, steps: bool) -> str:
    """The command run under a shell that stays, so that Slurm's warning before the time limit (SIGUSR1 to
    the batch shell alone, `--signal=B:USR1@N`) reaches the stage as the SIGTERM it saves a checkpoint on.
    After that warning the job requeues itself (`scontrol requeue`: the same job id, started again from its
    checkpoint) while its restarts are below `requeue_below`; else it exits LIMIT_EXIT, an interruption the
    executor submits again (or names). Where the command is `srun` (`steps`), the TERM goes to the job's steps
    (`scancel --signal=TERM JOB`): srun itself takes a TERM as "kill the step", and SIGKILLs its tasks a
    KillWait later, mid-checkpoint. A TERM to the batch shell (scancel --full, Slurm at the limit) reaches every
    process of the job already: the shell keeps waiting for the stage to finish its checkpoint."""
    stop = 'scancel --signal=TERM "$SLURM_JOB_ID"' if steps else 'kill -TERM "$eagle3_child" 2>/dev/null'
    requeue = "" if requeue_below is None else (
        f'if [ -n "$eagle3_limit" ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {requeue_below} ]; then\n'
        '    echo "eagle3: the stage stopped (exit status $eagle3_code); '
        + REQUEUE_LINE.format(job="$SLURM_JOB_ID", restart="$(( ${SLURM_RESTART_COUNT:-0} + 1 ))") + '"\n'
        '    scontrol requeue "$SLURM_JOB_ID" && sleep 60\n'
        "fi\n")
    return (
        "eagle3_limit=\n"
        f'eagle3_on_limit() {{ eagle3_limit=1; echo "{LIMIT_MARK} (SIGUSR1): stopping the stage with SIGTERM"; '
        f'{stop}; }}\n'
        "trap eagle3_on_limit USR1\n"
        "trap ':' TERM\n"
        f"{command} &\n"
        "eagle3_child=$!\n"
        'while :; do wait "$eagle3_child"; eagle3_code=$?; kill -0 "$eagle3_child" 2>/dev/null || break; done\n'
        + requeue +
        f'[ -n "$eagle3_limit" ] && exit {LIMIT_EXIT}\n'
        'exit "$eagle3_code"')


def batch_script(*, name: str, argv: list[str], stage: StageConfig, slurm: SlurmConfig, log: Path, cwd: Path) -> str:
    """The generated batch script: the job's shape as #SBATCH lines, then the stage's command."""
    job = stage.executor
    if not isinstance(job, SlurmSettings):
        raise TypeError(f"{name}: a batch script for a stage whose executor is {job.kind!r}, not slurm")
    opts = [f"--job-name={name}", f"--output={log}", "--open-mode=append", f"--chdir={cwd}", f"--nodes={job.nodes}",
            "--ntasks-per-node=1", f"--cpus-per-task={job.cpus_per_task}"]
    if job.gpus_per_node:
        opts.append(f"--gres=gpu:{job.gpus_per_node}")
    for flag, value in (("--mem", job.mem), ("--partition", slurm.partition), ("--account", slurm.account),
                        ("--qos", slurm.qos), ("--time", slurm.time)):
        if value:
            opts.append(f"{flag}={value}")
    if job.limit_signal_s:
        opts.append(f"--signal=B:USR1@{job.limit_signal_s}")
    opts.append("--requeue" if job.requeue else "--no-requeue")
    opts += [*slurm.extra_args, *job.slurm_args]
    lines = ["#!/bin/bash", f"# eagle3: the {name.split('-')[1]} stage as a Slurm job (generated; edits are overwritten)"]
    lines += [f"#SBATCH {o}" for o in opts]
    before, command = _command(argv, job)
    lines += ["export PYTHONUNBUFFERED=1", before + _wrapped(command, steps=command.startswith("srun "),
                                                             requeue_below=stage.max_restarts if job.requeue else None),
              ""]
    return "\n".join(lines)


def write_script(directory: Path, name: str, text: str) -> Path:
    """The script under the state directory (kept: what ran is readable afterwards)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.sh"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def is_local_host(host: str | None) -> bool | None:
    """Whether a job's node is this host (None: not known yet)."""
    import socket

    if not host:
        return None
    name = socket.gethostname()
    return host in (name, name.split(".")[0], "localhost", "127.0.0.1")
