""""Why is it stuck?": evidence gathered from a stage's own processes at the moment it is asked for.

- the Python stacks of every process of the stage's process group (every rank of a torchrun included, named by
  its RANK), from `py-spy dump --nonblocking` — a real binary, no ptrace code of our own, never pausing the
  stage (`native` pauses each process for the milliseconds py-spy reads its C/C++ frames) — run in parallel,
  each bounded in time; where py-spy is missing or has no permission, one line says why, and the rest is still
  gathered;
- for training, the collective each rank is in, from PyTorch's flight recorder (pipeline/train/flight.py);
- for extraction, the client's own account of its requests in flight (pipeline/observe/probes/client_state.py);
- for a server stage or the extraction it serves, the server's own view: `/v1/loads`, `/health`, and the queue
  and running requests from `/metrics`;
- the last 40 lines of the stage's log.

The whole is bounded (GATHER_BUDGET_S), summarised in a few lines (what the alert's thread shows) and written
under STATE_DIR/forensics/<run>/<time>-<stage>/evidence.txt; `eagle3 why STAGE` prints it. It never raises: what
could not be read is a line saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pipeline.config import Workspace
from pipeline.observe.probes.client_state import ask as ask_client
from pipeline.observe.probes.process import group_processes
from pipeline.observe.probes.remote import job_processes, node_name, run_on_nodes
from pipeline.stages.logfile import tail_lines
from pipeline.stages.slurm import is_local_host
from pipeline.states import StageProc, StageState
from pipeline.store import Store
from pipeline.train import flight
from pipeline.verdict import fmt_bytes, fmt_s

GATHER_BUDGET_S = 20.0  # all of it, py-spy included
LOG_LINES = 40
PYSPY_TIMEOUT_S = 10.0  # one process's dump
HEALTH_TIMEOUT_S = 3.0
LOOP_BLOCKED_S = 10.0  # the client's event loop turns twice a second: this long without a turn is a blocked call
FLIGHT_WAIT_S = 5.0  # how long the ranks have to dump their flight recorders once knocked
MAX_PROCESSES = 16  # stacks of at most this many processes (a torchrun of 8 ranks and their workers)


@dataclass
class Evidence:
    """What was gathered, as sections of text, and a one-line summary."""

    stage: str
    t: float
    summary: list[str] = field(default_factory=list)
    sections: list[tuple[str, str]] = field(default_factory=list)

    def text(self) -> str:
        head = [f"eagle3 why {self.stage} — gathered {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(self.t))}",
                *self.summary, ""]
        body = [f"=== {title} ===\n{text.rstrip()}\n" for title, text in self.sections]
        return "\n".join(head + body)


def pyspy_binary() -> str | None:
    """py-spy beside this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def _ptrace_scope() -> str:
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return "unknown"


def dump_stack(pid: int, *, binary: str | None, timeout_s: float = PYSPY_TIMEOUT_S,
               native: bool = False) -> tuple[str, str | None]:
    """(py-spy's dump of `pid`, or '', and why not when it could not be read). Non-blocking unless `native`: the
    process is never paused; native frames need py-spy to pause it while it reads (milliseconds), so they are
    only read when asked for (`eagle3 why STAGE --native`)."""
    if binary is None:
        return "", "py-spy is not installed (pip install py-spy, in the service's environment)"
    mode = "--native" if native else "--nonblocking"
    try:
        out = subprocess.run([binary, "dump", "--pid", str(pid), mode], capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "", f"py-spy did not answer within {timeout_s:.0f} s"
    except OSError as exc:
        return "", f"py-spy could not be run ({exc})"
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout, None
    err = (out.stderr or out.stdout).strip().splitlines()
    said = err[-1] if err else f"exit {out.returncode}"
    if any(w in (out.stderr or "") for w in ("Permission denied", "Operation not permitted", "EPERM")):
        return "", (f"no permission to read process {pid}'s stack (kernel.yama.ptrace_scope = {_ptrace_scope()}; run "
                    "eagle3 serve as root or as the stage's user): " + said)
    return "", f"py-spy could not read process {pid}: {said}"


OUR_THREADS = ("extract-state", "flight-recorder-dump", "parse-worker-", "reap-")  # bookkeeping, never the story
PY_FRAME = re.compile(r"\.py:\d+\)$|\(<[\w ]+>:\d+\)$")  # "f (x.py:12)", "<module> (<frozen runpy>:88)"
QUIET_FRAMES = ("(threading.py:", "(queue.py:")  # a thread parked on a lock or a queue: noise in a summary


def threads(dump: str) -> list[tuple[str, list[str]]]:
    """A py-spy dump's threads: (name, Python frames innermost first; native ones, from --native, left out)."""
    out: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            out.append((line.rsplit('"', 2)[-2] if line.endswith('"') else "", []))
        elif out and line.startswith("    ") and PY_FRAME.search(line):
            out[-1][1].append(line.strip())
    return out


def innermost(dump: str) -> str | None:
    """Where a process is: its main thread's innermost frame ("wait_in_collective (fixture.py:12)"), then its other
    threads grouped by theirs ("4 threads in SyncStream.read (httpcore/_backends/sync.py:128)"), leaving out our
    own bookkeeping threads and threads parked on a lock or a queue."""
    found = threads(dump)
    if not found:
        return None
    main = next((t for t in found if t[0] == "MainThread"), found[0])
    others = Counter(frames[0] for name, frames in found
                     if (name, frames) != main and frames and not name.startswith(OUR_THREADS)
                     and not any(q in frames[0] for q in QUIET_FRAMES) and frames[0] != next(iter(main[1]), None))
    said = [main[1][0]] if main[1] else []
    said += [f"{n} thread{'s' if n > 1 else ''} in {frame}" for frame, n in others.most_common(2)]
    return ", ".join(said) or None


def _processes(proc: StageProc | None) -> list[psutil.Process]:
    if proc is None or proc.pid is None or proc.has_ended:
        return []
    return group_processes(proc.pgid if proc.pgid is not None else proc.pid, proc.create_time or 0)[:MAX_PROCESSES]


def _collectives(fr_dir: Path, knocked: list[int], since: float, started: float, budget_s: float) -> list[str]:
    """The flight recorder's summary, once every knocked rank has dumped (or FLIGHT_WAIT_S has passed)."""
    if not knocked:
        return [f"no rank serves flight-recorder dumps under {fr_dir} (a trainer other than eagle3's on gloo, or "
                "one started before the recorder was on): the stacks stand alone"]
    deadline = min(started + budget_s, since + FLIGHT_WAIT_S)
    while True:
        # a second's slack: a filesystem with coarse timestamps may stamp a dump just made before the knock's time
        dumps = flight.read_dumps(fr_dir, knocked, since=since - 1.0)
        if all(isinstance(d, dict) for d in dumps.values()) or time.time() >= deadline:
            return flight.summarize(dumps, time.time())
        time.sleep(0.1)


def _entries(fr_dir: Path, ranks: list[int], last: int = 5) -> str:
    """Each rank's process groups' status and its last collectives, one line each (the whole dump stays beside)."""
    lines = []
    for rank, dump in sorted(flight.read_dumps(fr_dir, ranks, since=0).items()):
        if isinstance(dump, str):
            lines.append(f"rank {rank}: {dump}")
            continue
        for pg, st in sorted((dump.get("pg_status") or {}).items()):
            lines.append(f"rank {rank}, process group {pg}: last enqueued #{st.get('last_enqueued_collective')}, "
                         f"last completed #{st.get('last_completed_collective')}")
        for e in (dump.get("entries") or [])[-last:]:
            lines.append(f"  #{e.get('collective_seq_id')} {e.get('profiling_name')} {e.get('state')} "
                         f"sizes {e.get('input_sizes')} {'retired' if e.get('retired') else 'in flight'}")
    lines.append(f"(the whole dumps: {fr_dir}/rank_<N>.json)")
    return "\n".join(lines)


def _rank(p: psutil.Process) -> str:
    """" (rank N)" for a torchrun rank (its RANK variable), else ""."""
    try:
        rank = p.environ().get("RANK")
    except (psutil.Error, OSError):
        return ""
    return f" (rank {rank})" if rank is not None and rank.isdigit() else ""


def client_text(state: dict, now: float) -> str:
    """The client's own state, as lines a person reads (the summary says what it means)."""
    flight = state.get("in_flight") or []
    lines = [f"in flight ({len(flight)}):" + ("" if flight else " none")]
    lines += [f"  sample {r['sample']} ({r['tokens']:,} tokens) for {fmt_s(now - r['since'])}"
              + (f", parse worker {r['worker']}" if r.get("worker") else "") for r in flight[:20]]
    if len(flight) > 20:
        lines.append(f"  … and {len(flight) - 20} more")
    written = state.get("last_written")
    lines += [f"waiting to be sent: {state.get('waiting', 0)}; being stored: {state.get('storing', 0)}; "
              f"not yet recorded: {state.get('remaining')}",
              f"in-flight memory: {fmt_bytes(state.get('inflight_bytes') or 0)} of "
              f"{fmt_bytes(state.get('budget_bytes') or 0)}",
              f"server reachable: {'yes' if state.get('server_up') else 'no'}; stopping: "
              f"{'yes' if state.get('stopping') else 'no'}",
              "last sample written: " + (f"{written['sample']}, {fmt_s(now - written['t'])} ago" if written
                                         else "none by this process"),
              f"event loop's last turn: {fmt_s(max(0.0, now - float(state.get('loop_beat') or now)))} before the ask"]
    lines += [f"parse worker {w['pid']}: {w['requests']} request(s), "
              + ("running" if w.get("exit") is None else f"ended (exit {w['exit']})") for w in state.get("workers") or []]
    return "\n".join(lines)


def _python(p: psutil.Process) -> bool:
    try:
        return "python" in os.path.basename((p.cmdline() or [""])[0]) or "python" in p.name()
    except (psutil.Error, IndexError):
        return False


@dataclass
class ServerLoad:
    """The server's own count of the requests it runs and queues (None: not told), and where it was read."""

    running: float | None = None
    waiting: float | None = None
    source: str = ""


def _server_view(ws: Workspace, stage: str, timeout_s: float) -> tuple[str, ServerLoad] | None:
    """The SGLang server's own view of its load, where the stage is the server (or the extraction it serves):
    `/v1/loads` (0.5.23), `/health` and the queue gauges of `/metrics`."""
    url = ws.config.stages.server.url
    if stage not in ("server", "extract", "regenerate") or not url or not ws.config.stages.server.argv:
        return None  # no server stage in this workspace: nothing of ours to ask
    import httpx

    from pipeline.observe.probes.server import parse_metrics

    base, lines, load = url.rstrip("/"), [], ServerLoad()
    try:
        with httpx.Client(timeout=timeout_s) as client:
            try:
                r = client.get(f"{base}/v1/loads", params={"include": "core"})
                lines.append(f"GET /v1/loads: HTTP {r.status_code} {r.text.strip()[:600]}")
                loads = r.json().get("loads") if r.status_code == 200 else None
                if isinstance(loads, list) and loads:
                    load = ServerLoad(running=sum(float(x.get("num_running_reqs") or 0) for x in loads),
                                      waiting=sum(float(x.get("num_waiting_reqs") or 0) for x in loads),
                                      source="/v1/loads")
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                lines.append(f"GET /v1/loads: no answer ({type(exc).__name__})")
            try:  # SGLang's health check runs a 1-token generation: a wedged server takes its 20 s to say 503
                r = client.get(f"{base}/health", timeout=min(HEALTH_TIMEOUT_S, timeout_s))
                lines.append(f"GET /health: HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                lines.append(f"GET /health: no answer within {min(HEALTH_TIMEOUT_S, timeout_s):.0f} s "
                             f"({type(exc).__name__})")
            try:
                r = client.get(f"{base}/metrics")
                m = parse_metrics(r.text) if r.status_code == 200 else {}
                shown = {k: v for k, v in m.items() if any(w in k for w in ("running", "queue", "waiting"))}
                lines.append("metrics: " + (", ".join(f"{k} {v:g}" for k, v in sorted(shown.items()))
                                            or f"none about the queue (HTTP {r.status_code})"))
                if load.running is None and "sglang:num_running_reqs" in m:
                    load = ServerLoad(running=m["sglang:num_running_reqs"], waiting=m.get("sglang:num_queue_reqs"),
                                      source="/metrics")
            except (httpx.HTTPError, ValueError) as exc:
                lines.append(f"GET /metrics: no answer ({type(exc).__name__})")
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        lines.append(f"the server could not be asked ({type(exc).__name__}: {exc})")
    return "\n".join(lines), load


def _client_state(procs: list[psutil.Process]) -> dict | None:
    """The extraction client's own account (pipeline/observe/probes/client_state.py), from whichever process of the stage it is."""
    for p in procs:
        state = ask_client(p.pid)
        if state is not None:
            return state
    return None


def client_summary(state: dict | None, load: ServerLoad | None, now: float) -> list[str]:
    """The extraction client's state in a sentence or two: its requests in flight and their age, and what the
    server says of them ("the server holds them"), or why nothing is in flight."""
    if state is None:
        return ["client: its own state could not be read (not eagle3's extraction client, or it has ended)"]
    if "error" in state:
        return [f"client: its state could not be told ({state['error']})"]
    lines = []
    quiet = now - float(state.get("loop_beat") or now)
    if quiet > LOOP_BLOCKED_S:
        lines.append(f"client: its event loop has not run for {fmt_s(quiet)}: it is blocked in a call (its stack, "
                     "below, shows which)")
    flight = state.get("in_flight") or []
    written = state.get("last_written")
    last = (f"; the last sample written {fmt_s(now - written['t'])} ago (sample {written['sample']})" if written
            else "; no sample written yet by this process")
    if flight:
        oldest = flight[0]
        said = (f"client: {len(flight)} request{'s' if len(flight) != 1 else ''} in flight, the oldest "
                f"{fmt_s(now - oldest['since'])} (sample {oldest['sample']}, {oldest['tokens']:,} tokens)")
        if load is None or load.running is None:
            said += "; the server's own count is unknown (it did not answer /v1/loads or /metrics)"
        else:
            waiting = int(load.waiting or 0)
            said += f"; the server runs {int(load.running)}, queues {waiting}"
            if waiting:
                said += ": the server queues them"
            elif load.running:
                said += ": the server holds them"
            else:
                said += ": the server has none of them (lost between the client and the server)"
        lines.append(said + last)
    else:
        why = ("it is stopping" if state.get("stopping") else "it waits for the server to come back"
               if not state.get("server_up") else
               f"{state.get('waiting', 0)} sample(s) wait for room in the in-flight budget "
               f"({fmt_bytes(state.get('inflight_bytes') or 0)} of {fmt_bytes(state.get('budget_bytes') or 0)})"
               if state.get("waiting") else "no sample waits to be sent")
        lines.append(f"client: no request in flight: {why}{last}")
    dead = [w for w in state.get("workers") or [] if w.get("exit") is not None]
    if dead:
        lines.append("client: parse worker(s) ended: " + ", ".join(f"pid {w['pid']} (exit {w['exit']})" for w in dead))
    return lines


def stacks(procs: list[psutil.Process], *, native: bool, timeout_s: float, where: str = "") -> dict:
    """The processes listed (pid, rank, state, command) and the Python ones' stacks read by py-spy in parallel:
    {"listing": [...], "dumps": [[pid, " (rank N)", dump, why], ...]}; `where` (" on NODE") names the node."""
    listing, ranks = [], {p.pid: _rank(p) for p in procs}
    for p in procs:
        try:
            listing.append(f"pid {p.pid}{ranks[p.pid]}{where} {p.status():<9} {' '.join(p.cmdline())[:200]}")
        except psutil.Error as exc:
            listing.append(f"pid {p.pid}{where}: {type(exc).__name__}")
    pythons = [p for p in procs if _python(p)]
    binary = pyspy_binary()
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(pythons)))) as pool:
        dumps = list(pool.map(lambda p: [p.pid, ranks[p.pid] + where, *dump_stack(
            p.pid, binary=binary, timeout_s=timeout_s, native=native)], pythons))
    return {"listing": listing, "dumps": dumps}


def node_stacks(job_id: str, *, native: bool, timeout_s: float, flight_dir: str | None) -> dict:
    """On one of a Slurm job's nodes (`eagle3 probe --stacks`, through `srun --overlap`): the job's processes here
    and their stacks, after knocking on this node's ranks' flight recorders (a FIFO is its node's own)."""
    node = node_name()
    procs, _ = job_processes(job_id, node)
    knocked_at = time.time()
    knocked = flight.request_dumps(Path(flight_dir)) if flight_dir else []
    out = {"node": node, "knocked": knocked, **stacks(procs[:MAX_PROCESSES], native=native, timeout_s=timeout_s,
                                                      where=f" on {node}")}
    if flight_dir and knocked:  # the dumps as this node wrote them: the controller may not share this directory
        deadline = knocked_at + FLIGHT_WAIT_S
        while not all(isinstance(d, dict) for d in flight.read_dumps(Path(flight_dir), knocked,
                                                                     since=knocked_at - 1.0).values()):
            if time.time() >= deadline:
                break
            time.sleep(0.1)
        out["flight"] = {}
        for rank in knocked:
            try:
                out["flight"][str(rank)] = (Path(flight_dir) / f"rank_{rank}{flight.DUMP_SUFFIX}").read_text()
            except OSError:
                continue
    return out


def _copy_dumps(fr_dir: Path, nodes: list[dict], since: float) -> None:
    """The ranks' dumps read on their nodes, written here where this host's copy is missing or older (a state
    directory the nodes do not share); on a shared one they are the same files, left as they are."""
    for node in nodes:
        for rank, text in (node.get("flight") or {}).items():
            path = fr_dir / f"rank_{rank}{flight.DUMP_SUFFIX}"
            try:
                if path.exists() and path.stat().st_mtime >= since - 1.0:
                    continue
                fr_dir.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            except OSError:
                continue


def _job_stacks(ws: Workspace, proc: StageProc, *, native: bool, timeout_s: float) -> tuple[list[dict], str | None]:
    """The stacks of a running Slurm job's processes, read on its nodes (here, where it runs on this host)."""
    fr_dir = str(ws.flight_dir(proc.run_id)) if proc.stage == "train" else None
    nodes = proc.job_nodes or proc.job_host
    if not nodes:
        return [], f"Slurm job {proc.job_id} has no node yet"
    if is_local_host(nodes):
        return [node_stacks(proc.job_id or "", native=native, timeout_s=timeout_s, flight_dir=fr_dir)], None
    args = ["--stacks", "--timeout", f"{timeout_s:g}"] + (["--native"] if native else []) + (
        ["--flight-dir", fr_dir] if fr_dir else [])
    got = run_on_nodes(proc.job_id or "", nodes, args, timeout_s=timeout_s + 15)
    return (got, None) if isinstance(got, list) else ([], got)


def gather(ws: Workspace, store: Store, stage: str, *, budget_s: float = GATHER_BUDGET_S, clock=time.time,
           native: bool = False) -> Evidence:
    """Everything this module gathers about `stage`, now, within `budget_s` (`native`: see `dump_stack`). A Slurm
    job's processes are read on their own nodes, through `srun --overlap` (pipeline/observe/probes/remote.py)."""
    started = time.monotonic()
    ev = Evidence(stage=stage, t=clock())
    proc = store.latest_proc(stage)
    procs = _processes(proc)
    fr_dir, knocked_at = ws.flight_dir(proc.run_id if proc else None), time.time()
    knocked = None
    if stage == "train" and procs:  # knocked first: the ranks dump while py-spy reads their stacks
        knocked = flight.request_dumps(fr_dir)
    left = max(1.0, budget_s - (time.monotonic() - started))
    if proc is not None and proc.is_job and proc.state == StageState.RUNNING and proc.job_id:
        nodes, why = _job_stacks(ws, proc, native=native, timeout_s=min(PYSPY_TIMEOUT_S, left))
        if why:
            ev.summary.append(f"{stage}: its processes could not be read on its nodes: {why}")
        if stage == "train" and nodes:
            knocked = sorted({r for n in nodes for r in n.get("knocked") or []})
            _copy_dumps(fr_dir, nodes, knocked_at)
        read = {"listing": [x for n in nodes for x in n.get("listing") or []],
                "dumps": [d for n in nodes for d in n.get("dumps") or []]}
        count = len(read["listing"])
    else:
        read = stacks(procs, native=native, timeout_s=min(PYSPY_TIMEOUT_S, left))
        count = len(procs)
    if not count:
        ev.summary.append(f"{stage}: no live process to read (not started, or ended)")
    if read["listing"]:
        ev.sections.append((f"{count} process(es) of {stage}", "\n".join(read["listing"])))
    dumps = read["dumps"]
    reasons = sorted({why for _, _, _, why in dumps if why})
    where = [f"pid {pid}{rank} in {innermost(text)}" for pid, rank, text, _ in dumps if text and innermost(text)]
    if where:
        ev.summary.append(f"{stage}: " + "; ".join(where[:8]) + ("; …" if len(where) > 8 else ""))
    for reason in reasons:
        ev.summary.append(f"stacks: {reason}")
    for pid, rank, text, why in dumps:
        ev.sections.append((f"stack of pid {pid}{rank} (py-spy dump)", text or why or "empty"))
    if knocked is not None:
        ev.summary += [f"collectives: {line}" for line in _collectives(fr_dir, knocked, knocked_at, started, budget_s)]
        ev.sections.append(("the flight recorder (PyTorch), each rank's last collectives", _entries(fr_dir, knocked)))
    left = max(1.0, budget_s - (time.monotonic() - started))
    server = _server_view(ws, stage, timeout_s=min(5.0, left))
    if server:
        ev.sections.append(("the SGLang server's own view", server[0]))
    if stage == "extract" and procs:
        state = _client_state(procs)
        ev.summary[:0] = client_summary(state, server[1] if server else None, clock())
        if state is not None:
            ev.sections.append(("the extraction client's own state",
                                client_text(state, clock()) if "error" not in state else state["error"]))
    log = ws.log_path(stage)
    tail = tail_lines(log, LOG_LINES)
    ev.sections.append((f"the last {LOG_LINES} lines of {log}", "\n".join(tail) if tail else "(empty or missing)"))
    return ev


def keep(ws: Workspace, ev: Evidence, run: str | None) -> Path | str:
    """Write the evidence under STATE_DIR/forensics/<run>/<time>-<stage>/evidence.txt; returns the file, or why it
    could not be written (a full disk loses the copy, never the answer)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ev.t))
    directory = ws.forensics_dir(run) / f"{stamp}-{ev.stage}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "evidence.txt"
        path.write_text(ev.text())
    except OSError as exc:
        return f"not kept: {directory} is not writable ({exc.strerror or exc})"
    return path
