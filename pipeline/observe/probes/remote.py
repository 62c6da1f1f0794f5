"""A Slurm job's processes read on its own nodes, through Slurm.

The controller's host sees only its own processes and GPUs. For a job on other nodes, `srun --overlap
--jobid N --nodelist NODES` runs `eagle3 probe --json` inside the job's allocation, once per node: the
same fields the local probes give (the processes' count, CPU time, bytes written, waits on the disk,
stopped members; the job's GPUs through NVML; its output directory's files), one JSON line a node. The
diagnosis then judges a remote stage as it judges a local one. A job on this host is read here, without
srun, by the same code. Slurm is the only way in: no daemon of ours runs on the nodes.

A reading never raises: a node that does not answer, or an srun that Slurm refuses, is unknown with
Slurm's own words, never zero. Readings are refreshed at most every `every_s` (an srun is a step launch
on the cluster); between two, the last is shown with its age.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from pipeline.observe.probes import Reading
from pipeline.observe.probes.files import FileScanner
from pipeline.observe.probes.gpu import nvml_or_fake
from pipeline.observe.probes.process import totals
from pipeline.stages import slurm
from pipeline.stages.slurm import is_local_host
from pipeline.states import StageProc

PROBE_ENV = "EAGLE3_PROBE"  # set in the probe's own step: its processes are not the stage's
NODE_PROGRAM = "pipeline.observe.nodeprobe"  # `eagle3 probe`, run on the nodes
SRUN_TIMEOUT_S = 30.0
VIA = "srun --overlap"


def job_processes(job_id: str, node: str | None = None) -> tuple[list[psutil.Process], set[int] | None]:
    """The processes of Slurm job `job_id` on this node, and the GPU indices Slurm gave the job here (its
    SLURM_JOB_GPUS; None where it does not say): every process Slurm started for the job carries SLURM_JOB_ID
    (and SLURMD_NODENAME) in its environment; the probe's own step is left out. Processes whose environment
    cannot be read (another user's) are not the job's as far as this reading knows."""
    me, out, gpus = os.getpid(), [], None
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_JOB_ID") != job_id or PROBE_ENV in env:
            continue
        if node and env.get("SLURMD_NODENAME", node) != node:
            continue
        out.append(p)
        gpus = gpus if gpus is not None else _indices(env.get("SLURM_JOB_GPUS"))
    return out, gpus


def node_name() -> str:
    """This node's name as Slurm knows it (SLURMD_NODENAME, inside a job's step), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def node_reading(job_id: str, *, files_dir: str | None = None, suffix: str = "", fake_gpus: int = 0) -> dict:
    """What `eagle3 probe --json` prints on one node: its name, the time, the job's processes' totals, the job's
    GPUs (NVML; `fake_gpus` idle ones in tests), the output directory's files; unknown parts under "unknown"."""
    node = node_name()
    members, held = job_processes(job_id, node)
    out: dict = {"node": node, "t": round(time.time(), 3), **totals(members)}
    unknown: dict[str, str] = {}
    gpus = nvml_or_fake(fake_gpus).read({p.pid: "job" for p in members})
    if gpus.unknown:
        unknown["gpus"] = gpus.unknown
    else:
        out["gpus"] = [{**g, "node": node} for g in gpus.value if held is None or g.get("index") in held]
    if files_dir:
        files = FileScanner(files_dir, suffix=suffix).scan()
        if files.unknown:
            unknown["files"] = files.unknown
        else:
            out["files"] = files.value
    if unknown:
        out["unknown"] = unknown
    return out


def _indices(text: str | None) -> set[int] | None:
    """"0,3" as {0, 3}; None for nothing or something else."""
    if not text:
        return None
    try:
        return {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        return None


def combine(lines: list[dict]) -> dict:
    """Per-node readings as one process section: totals added up, each node's own figures kept."""
    value: dict = {"members": 0, "cpu_s": 0.0, "io_write_bytes": 0, "disk_wait": 0, "stopped": 0, "zombie": False}
    nodes: dict[str, dict] = {}
    gpus: list[dict] = []
    for line in lines:
        for key in ("members", "disk_wait", "stopped"):
            value[key] += int(line.get(key) or 0)
        value["cpu_s"] = round(value["cpu_s"] + float(line.get("cpu_s") or 0.0), 3)
        if value["io_write_bytes"] is not None:
            value["io_write_bytes"] = None if line.get("io_write_bytes") is None else \
                value["io_write_bytes"] + int(line["io_write_bytes"])
        value["zombie"] = value["zombie"] or bool(line.get("zombie"))
        gpus += line.get("gpus") or []
        nodes[line.get("node", "?")] = {k: line.get(k) for k in ("members", "cpu_s", "stopped", "disk_wait", "files",
                                                                  "unknown") if line.get(k) is not None}
    value["remote_nodes"] = nodes
    value["remote_gpus"] = gpus
    return value


class RemoteProbe:
    """Reads Slurm jobs' processes on their nodes; one per sampler. Thread-safe: the sampler's probe threads
    call `read` for several stages at once."""

    def __init__(self, *, every_s: float, fake_gpus: int = 0, clock=time.time, python: str = sys.executable,
                 timeout_s: float = SRUN_TIMEOUT_S) -> None:
        self.every_s, self.fake_gpus, self.clock, self.python, self.timeout_s = every_s, fake_gpus, clock, python, timeout_s
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, dict, str]] = {}  # job id → (when read, the reading, how)
        self._failed: dict[str, tuple[float, Reading]] = {}  # job id → (when it last could not be read, what was said)

    def read(self, row: StageProc, *, files_dir: str | None = None, suffix: str = "") -> Reading:
        """The process section for a running Slurm job: Slurm's word that it runs, and its processes' figures read
        on its nodes (with where, how and how old), or why they cannot be read."""
        now = self.clock()
        base = {"alive": True, "exit_code": None, "stop_requested": bool(row.stop_requested), "job_id": row.job_id,
                "queued": False}
        job = row.job_id or ""
        with self._lock:
            held, failed = self._last.get(job), self._failed.get(job)
        if failed is not None and now - failed[0] < self.every_s:
            return failed[1]  # tried again no sooner than a reading would be
        if held is None or now - held[0] >= self.every_s:
            got = self._fresh(row, files_dir=files_dir, suffix=suffix)
            if isinstance(got, str):
                why = f"{got}; Slurm says job {job} is running" + (
                    f" (the last reading, {now - held[0]:.0f}s old, is not used)" if held else "")
                second = slurm.sstat(job)  # Slurm's own accounting speaks where the nodes could not be read
                reading = Reading(t=now, value={**base, **second, "remote": {
                    "via": "sstat (Slurm's accounting)", "age_s": 0.0, "nodes": {}}},
                    unknown=f"{why}; CPU time and memory from sstat (Slurm's accounting)") \
                    if isinstance(second, dict) else Reading(t=now, value=base, unknown=f"{why}; {second}")
                with self._lock:
                    self._failed[job] = (now, reading)
                return reading
            with self._lock:
                self._failed.pop(job, None)
                held = self._last[job] = (self.clock(), got[0], got[1])
        t, value, how = held
        return Reading(t=now, value={**base, **value, "remote": {"via": how, "age_s": round(max(0.0, now - t), 1),
                                                                 "nodes": value["remote_nodes"]}})

    def forget(self, keep: set[str]) -> None:
        """Drop the readings of jobs no longer followed."""
        with self._lock:
            for job in set(self._last) - keep:
                del self._last[job]
            for job in set(self._failed) - keep:
                del self._failed[job]

    def _fresh(self, row: StageProc, *, files_dir: str | None, suffix: str) -> tuple[dict, str] | str:
        """(the combined reading, how it was read), or why it could not be."""
        nodes = row.job_nodes or row.job_host
        if not nodes:
            return f"Slurm job {row.job_id} has no node yet"
        if is_local_host(nodes):  # this host: read here, no step launched on the cluster
            return combine([node_reading(row.job_id or "", files_dir=files_dir, suffix=suffix,
                                         fake_gpus=self.fake_gpus)]), "this host"
        args = (["--files", files_dir] + (["--suffix", suffix] if suffix else []) if files_dir else []) + (
            ["--fake-gpus", str(self.fake_gpus)] if self.fake_gpus else [])
        got = run_on_nodes(row.job_id or "", nodes, args, timeout_s=self.timeout_s, python=self.python)
        return (combine(got), f"{VIA} on {nodes}") if isinstance(got, list) else got


def run_on_nodes(job_id: str, nodes: str, args: list[str], *, timeout_s: float = SRUN_TIMEOUT_S,
                 python: str = sys.executable) -> list[dict] | str:
    """`eagle3 probe --json --job JOB ARGS` on each of the job's `nodes`, inside its allocation (`srun --overlap`):
    one JSON object a node, or why they could not be read (srun's own words). One srun a node, in parallel: srun
    interleaves its tasks' output, and a long line (a rank's stacks, its flight-recorder dump) is cut in chunks."""
    names = slurm.hostnames(nodes) if ("[" in nodes or "," in nodes) else [nodes]
    if not names:
        return f"cannot expand Slurm's node list {nodes!r}"
    with ThreadPoolExecutor(max_workers=min(16, len(names)), thread_name_prefix="srun") as pool:
        got = list(pool.map(lambda node: _run_on(job_id, node, args, timeout_s=timeout_s, python=python), names))
    failed = [g for g in got if isinstance(g, str)]
    return "; ".join(failed) if failed else [g for g in got if isinstance(g, dict)]


def _run_on(job_id: str, node: str, args: list[str], *, timeout_s: float, python: str) -> dict | str:
    argv = ["srun", "--overlap", f"--jobid={job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--quiet",
            f"--export=ALL,{PROBE_ENV}=1", python, "-m", NODE_PROGRAM, "--json", "--job", job_id, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=_root())
    except FileNotFoundError:
        return "cannot read the job's nodes: `srun` is not on PATH"
    except subprocess.TimeoutExpired:
        return f"`{VIA}` on {node} did not answer within {timeout_s:.0f} s"
    except OSError as exc:
        return f"cannot run srun: {exc.strerror}"
    for text in reversed(r.stdout.splitlines()):
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if r.returncode == 0 and isinstance(line, dict) and "node" in line:
            return line
    said = next((x.strip() for x in r.stderr.splitlines() if x.strip()), "") or (
        f"exit status {r.returncode}" if r.returncode else f"no reading in its output ({len(r.stdout)} characters)")
    return f"`{VIA}` on {node} failed: {said}"


def _root() -> str:
    """The directory the probe runs from (the project's, where it is not installed as a package)."""
    return str(Path(__file__).resolve().parents[3])

