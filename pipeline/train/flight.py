"""PyTorch's flight recorder for a stalled training: which collective each rank is in, dumped on request.

The train stage is started with the recorder on (`flight_env`): PyTorch keeps the last collectives of every
process group in a ring buffer, for NCCL and, since 2.7, for gloo. How a dump is asked for:
- NCCL: PyTorch's own pipe (`TORCH_NCCL_DEBUG_INFO_PIPE_FILE`): a write to `<prefix><rank>.pipe` makes the rank
  dump to `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` (a pickle, for PyTorch's `fr_trace` tool), and a timeout dumps too;
  this works for any trainer the stage runs.
- every backend, in our trainer (`serve_dumps`): a daemon thread waits on a FIFO `<prefix><rank>.request`; a write
  to it makes the rank dump the recorder as JSON to `<prefix><rank>.json`. A rank blocked in a collective has
  released the GIL (gloo and NCCL both wait in C++), so the thread answers; a rank spinning in Python may not.

Nothing here imports torch at import time: the service reads the dumps without it.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

PREFIX_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # PyTorch's own name for where a flight-recorder dump goes
BUFFER_ENTRIES = "2000"  # collectives kept per process (about 300 bytes each)
REQUEST_SUFFIX = ".request"
DUMP_SUFFIX = ".json"
NO_DUMP = "no dump yet (the rank's Python did not run: it holds the GIL, or is stopped)"
MOVING_S = 10.0  # a collective entered this recently: the ranks are at work, not stuck in it


def flight_env(directory: Path) -> dict[str, str]:
    """The environment that turns the recorder on, with its dumps under `directory` (one per run)."""
    return {"TORCH_FR_BUFFER_SIZE": BUFFER_ENTRIES, "TORCH_NCCL_TRACE_BUFFER_SIZE": BUFFER_ENTRIES,
            PREFIX_ENV: str(directory / "rank_"),
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(directory / "nccl_rank_"),
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(directory / "nccl_rank_"),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def serve_dumps(rank: int, backend: str) -> str | None:
    """In a rank, after `init_process_group`: answer dump requests from a daemon thread. Returns the FIFO's path, or
    None where the recorder is off (no `TORCH_FR_DUMP_TEMP_FILE`) or the FIFO cannot be made (a warning, once)."""
    prefix = os.environ.get(PREFIX_ENV)
    if not prefix:
        return None
    request = f"{prefix}{rank}{REQUEST_SUFFIX}"
    try:
        Path(request).parent.mkdir(parents=True, exist_ok=True)
        if not (os.path.exists(request) and stat.S_ISFIFO(os.stat(request).st_mode)):
            Path(request).unlink(missing_ok=True)
            os.mkfifo(request, 0o600)
    except OSError as exc:
        print(f"warning: flight recorder dumps on request are off: cannot make {request} ({exc.strerror or exc})",
              flush=True)
        return None
    threading.Thread(target=_answer, args=(request, f"{prefix}{rank}{DUMP_SUFFIX}", backend),
                     name="flight-recorder-dump", daemon=True).start()
    return request


def _answer(request: str, out: str, backend: str) -> None:
    while True:
        try:
            with open(request, "rb") as fh:  # blocks until a writer comes; its bytes are only the knock
                fh.read()
            text = dump_json(backend)
            tmp = f"{out}.tmp"
            with open(tmp, "w") as fh:
                fh.write(text)
            os.replace(tmp, out)
        except Exception as exc:  # noqa: BLE001 - a dump that fails must never end the rank
            try:
                Path(out).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            except OSError:
                return


def dump_json(backend: str) -> str:
    """This process's flight recorder as JSON text (PyTorch's own dump)."""
    from torch._C import _distributed_c10d as c10d

    fn = getattr(c10d, "_dump_nccl_trace_json", None) if backend == "nccl" else None
    fn = fn or getattr(c10d, "_dump_fr_trace_json")  # noqa: B009 - private, absent from torch's stubs
    text = fn(True, False)  # collectives included, completed ones too: the last completed is the evidence
    return text.decode() if isinstance(text, bytes) else text


# --- the reader's side (the service) -------------------------------------------------------------------------


def request_dumps(directory: Path) -> list[int]:
    """Knock on every rank's request FIFO (and PyTorch's NCCL pipes) without blocking; returns the ranks knocked."""
    knocked: list[int] = []
    if not directory.is_dir():
        return knocked
    for path in sorted(directory.iterdir()):
        if not (path.name.endswith(REQUEST_SUFFIX) or path.name.endswith(".pipe")):
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody reads it (the rank has ended)
        except OSError:
            continue
        try:
            os.write(fd, b"1")
        except OSError:
            pass
        finally:
            os.close(fd)
        if path.name.endswith(REQUEST_SUFFIX) and path.name.startswith("rank_"):
            rank = path.name.removeprefix("rank_").removesuffix(REQUEST_SUFFIX)
            if rank.isdigit():
                knocked.append(int(rank))
    return knocked


def read_dumps(directory: Path, ranks: list[int], *, since: float) -> dict[int, dict | str]:
    """Each knocked rank's dump written after `since` (wall time), or why there is none."""
    out: dict[int, dict | str] = {}
    for rank in ranks:
        path = directory / f"rank_{rank}{DUMP_SUFFIX}"
        try:
            if path.stat().st_mtime < since:
                out[rank] = NO_DUMP
                continue
            data = json.loads(path.read_text())
        except FileNotFoundError:
            out[rank] = NO_DUMP
            continue
        except (OSError, ValueError) as exc:
            out[rank] = f"unreadable dump ({type(exc).__name__}: {exc})"
            continue
        out[rank] = data if "error" not in data else f"the dump failed: {data['error']}"
    return out


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 4, 5, 6, 7] -> "0–2, 4–7"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs)


def _ranks_word(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + _ranges(ranks)


def _position(dump: dict) -> dict[str, tuple[int, int, str, float | None]]:
    """Per process group: (last enqueued collective's number, last completed's, the enqueued one's op, when it was
    enqueued, as wall seconds)."""
    ops: dict[tuple[str, int], tuple[str, float | None]] = {}
    for e in dump.get("entries") or []:
        if not e.get("is_p2p"):
            created = e.get("time_created_ns")
            ops[(str(e.get("pg_id")), int(e.get("collective_seq_id", -1)))] = (
                str(e.get("profiling_name", "?")), created / 1e9 if isinstance(created, (int, float)) else None)
    out = {}
    for pg, st in (dump.get("pg_status") or {}).items():
        enq, done = int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective", -1))
        name, created = ops.get((str(pg), enq), ("?", None))
        out[str(pg)] = (enq, done, name.split(":", 1)[-1], created)
    return out


def summarize(dumps: dict[int, dict | str], now: float) -> list[str]:
    """One line per finding: which rank waits in which collective and for how long, and which ranks are behind.
    A collective entered less than MOVING_S ago is a run at work, whatever the ranks' numbers at that instant."""
    lines = [f"rank {r}: {d}" for r, d in sorted(dumps.items()) if isinstance(d, str)]
    read = {r: _position(d) for r, d in dumps.items() if isinstance(d, dict)}
    if not read:
        return lines or ["no rank's flight recorder could be read"]
    groups = sorted({pg for pos in read.values() for pg in pos})
    told = False
    for pg in groups:
        at = {r: pos[pg] for r, pos in read.items() if pg in pos}
        top = max(p[0] for p in at.values())
        ahead = sorted(r for r, p in at.items() if p[0] == top)
        behind = sorted(r for r, p in at.items() if p[0] < top)
        op = next(p[2] for p in at.values() if p[0] == top)
        entered = [p[3] for r, p in at.items() if r in ahead and p[3] is not None]
        waited = now - min(entered) if entered else None
        group = "" if pg == "0" else f" (process group {pg})"
        pending = any(p[1] < p[0] for r, p in at.items() if r in ahead)
        ago = f", entered {fmt_age(waited)} ago" if waited is not None else ""
        if not behind and not pending or waited is not None and waited < MOVING_S:
            if pg == "0" or len(groups) == 1:
                lowest = min(p[0] for p in at.values())
                span = f"#{top:,}" if lowest == top else f"#{lowest:,}–#{top:,}"
                lines.append(f"every rank has finished {op} #{top:,}{group}{ago}: none waits in a collective"
                             if not behind and not pending else
                             f"collectives are moving{group}: the ranks are at {op} {span}{ago}")
                told = True
            continue
        since = f" for {fmt_age(waited)}" if waited is not None else ""
        if behind:
            lows = sorted({at[r][0] for r in behind})
            low = "#" + ", #".join(f"{n:,}" for n in lows)
            lines.append(f"{_ranks_word(ahead)} {'waits' if len(ahead) == 1 else 'wait'} in {op} #{top:,}{group}"
                         f"{since}; {_ranks_word(behind)} {'is' if len(behind) == 1 else 'are'} at {low} → "
                         f"{_ranks_word(behind)} {'is' if len(behind) == 1 else 'are'} behind")
        else:
            lines.append(f"every rank has been in {op} #{top:,}{group}{since} and none is behind: the collective "
                         "itself does not complete (the network, or a rank's device)")
        told = True
    if not told:
        lines.append("every process group: all ranks at the same collective")
    return lines


def fmt_age(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{(s % 3600) // 60:02d}m"
