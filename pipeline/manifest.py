"""The extraction manifest: `OUT/manifest.sqlite`, the authoritative per-sample record.

Table `samples`: idx INTEGER PRIMARY KEY (the data line, from 0), id, status
('done' | 'failed'), tokens, bytes, attempts, error, finished_at (unix seconds), latency_s (the
successful request's own seconds, send to last byte; NULL in older manifests), line_hash (the
data line's content key, `pipeline/extract/dataset.line_key`; NULL in older manifests): a sample
is this data's only while its line still reads the same (`Manifest.reconcile`), topk_mass (where the
final layer is absent: the target probability the stored top-K logprobs hold, averaged over the sample's
positions; NULL otherwise and in older manifests).
Table `meta`: key, value — dataset_sha256, samples_total, tokens_total, model,
layers, hidden_size, layer_ids, layer_convention, final_layer,
final_slot ("post-norm": the final layer as this project's server side returns it; "pre-norm":
speculators' convention, the trainer applies the target's final norm).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

MANIFEST_NAME = "manifest.sqlite"
MASS_WARN = 0.95  # a top-K holding less of the target's probability than this, on average, is warned about
SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    idx INTEGER PRIMARY KEY, id TEXT, status TEXT NOT NULL CHECK (status IN ('done', 'failed')),
    tokens INTEGER, bytes INTEGER, attempts INTEGER, error TEXT, finished_at REAL, latency_s REAL,
    line_hash TEXT, topk_mass REAL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
"""


# Filesystems a job on another host may share with the controller. SQLite's WAL mode needs every
# process using the database on one host (its -shm index is shared memory); on these the
# manifest uses a rollback journal, which takes POSIX locks the network filesystem carries.
NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "ceph", "glusterfs", "9p",
              "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "fuse.juicefs", "afs", "pvfs2", "orangefs", "wekafs")
FORCE_NETWORK_ENV = "EAGLE3_NETWORK_FS"  # "1": treat every directory as shared across hosts (tests, odd mounts)


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/mounts)."""
    target, best, kind = str(Path(path).resolve()), -1, None
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), parts[2]
    return kind


def shared_across_hosts(directory: Path) -> bool:
    """True where a writer and a reader may sit on different hosts (a network filesystem)."""
    if os.environ.get(FORCE_NETWORK_ENV) == "1":
        return True
    return (filesystem_type(directory) or "") in NETWORK_FS


def open_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection that never creates the file."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def summarize(out_dir: Path) -> dict:
    """{done, failed, total, tokens_done, tokens_total, tokens_sq_done, tokens_sq_total, layers, hidden_size,
    inflight_bytes, max_inflight_bytes};
    raises OSError/sqlite3.Error."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path}: no manifest yet")
    conn = open_readonly(path)
    try:
        counts = {s: (n, t or 0, q or 0) for s, n, t, q in conn.execute(
            "SELECT status, COUNT(*), SUM(tokens), SUM(tokens * tokens) FROM samples GROUP BY status")}
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        latency = _latency_profile(conn)
        # the top-K's captured mass over the done samples that recorded one: mean, and how many fall below MASS_WARN
        mass = conn.execute("SELECT AVG(topk_mass), COUNT(topk_mass), SUM(topk_mass < ?) FROM samples "
                            "WHERE status = 'done' AND topk_mass IS NOT NULL", (MASS_WARN,)).fetchone()
    finally:
        conn.close()
    as_int = lambda k: int(meta[k]) if meta.get(k) not in (None, "") else None  # noqa: E731
    done, failed = counts.get("done", (0, 0, 0)), counts.get("failed", (0, 0, 0))
    sq_total = as_int("tokens_sq_total")  # absent in manifests written before it was recorded
    return {"done": done[0], "failed": failed[0], "total": as_int("samples_total"),
            "tokens_done": done[1] + failed[1], "tokens_total": as_int("tokens_total"), "unit": "samples",
            "tokens_sq_done": done[2] + failed[2] if sq_total is not None else None, "tokens_sq_total": sq_total,
            "layers": as_int("layers"), "hidden_size": as_int("hidden_size"),
            # answers in memory at the client, and its budget (absent from manifests of clients before 2026-12-03)
            "inflight_bytes": as_int("inflight_bytes"), "max_inflight_bytes": as_int("max_inflight_bytes"),
            "run": meta.get("run") or None,  # the run whose extraction last wrote it (EAGLE3_RUN), where known
            # the done samples' request latencies: raw sums per length bin (LATENCY_SUMS, in order), from which
            # pipeline/observe/latency.py builds the ETA's cost shape; None before latencies were kept
            "latency_bins": latency,
            # the target probability the stored top-K holds (absent where the final layer is stored instead)
            **({"topk_mass": round(mass[0], 4), "topk_mass_samples": mass[1], "topk_mass_low": int(mass[2] or 0)}
               if mass and mass[1] else {})}


def mass_line(summary: dict) -> str | None:
    """"the stored top-K logprobs hold 97.3 % of the target's probability (mean of 1,200 samples)", with a warning
    below MASS_WARN: a target missing its tail is sharper than the target, which costs acceptance under sampling.
    None where no sample recorded it (the final layer was stored: the whole distribution)."""
    mass = summary.get("topk_mass") if isinstance(summary, dict) else None
    if not isinstance(mass, (int, float)):
        return None
    line = (f"the stored top-K logprobs hold {100 * mass:.1f} % of the target's probability "
            f"(mean of {summary.get('topk_mass_samples', 0):,} samples")
    low = summary.get("topk_mass_low") or 0
    line += f"; {low:,} below {100 * MASS_WARN:.0f} %)" if low else ")"
    if mass < MASS_WARN:
        line += (f" — WARNING: below {100 * MASS_WARN:.0f} % on average, the training target is sharper than the "
                 "target's own distribution; extract again with a larger --target-topk")
    return line


# floor(log2(tokens)) in SQL (SQLite's math functions are optional): the power-of-two length bin
_LOG2 = " + ".join(f"(tokens >= {1 << k})" for k in range(1, 31))
_PROFILE_SQL = (
    f"SELECT {_LOG2} AS b, COUNT(*), SUM(1.0 / tokens), SUM(1.0 / (tokens * tokens)), SUM(tokens), "
    "SUM(1.0 * tokens * tokens), SUM(latency_s / tokens), SUM(latency_s / (1.0 * tokens * tokens)), "
    "SUM(latency_s), SUM(latency_s * latency_s / (1.0 * tokens * tokens)) "
    "FROM samples WHERE status = 'done' AND latency_s IS NOT NULL AND tokens > 0 GROUP BY b")


# what each bin's sums are, in the order `summarize` gives them (with s = latency / tokens: the count, Σ1/tokens,
# Σ1/tokens², Σtokens, Σtokens², Σs, Σs/tokens, Σs·tokens = Σlatency, Σs²); pipeline/observe/latency.py's moments
LATENCY_SUMS = ("samples", "sum_inv", "sum_inv_sq", "sum_tokens", "sum_tokens_sq",
                "sum_s", "sum_s_inv", "sum_s_tokens", "sum_s_sq")


def _latency_profile(conn: sqlite3.Connection) -> dict[int, list[float]] | None:
    """{bin's lower bound in tokens: the LATENCY_SUMS of its done samples}; None for a manifest from before
    latencies were kept."""
    try:
        rows = conn.execute(_PROFILE_SQL).fetchall()
    except sqlite3.OperationalError:  # no latency_s column
        return None
    return {1 << int(b): [float(v) for v in vals] for b, *vals in rows} or None


def read_done(out_dir: Path) -> tuple[dict[str, str], list[int]]:
    """(meta, the indices of the samples done, ascending) of an extraction's manifest, read-only;
    raises FileNotFoundError (no manifest) or sqlite3.Error (unreadable)."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path}: no manifest")
    conn = open_readonly(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        done = [r[0] for r in conn.execute("SELECT idx FROM samples WHERE status = 'done' ORDER BY idx")]
    finally:
        conn.close()
    return meta, done




class Keys(Protocol):
    """Each data line's content key, by line: a list, or the extraction's compact `LineKeys`."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> str: ...

    def __iter__(self) -> Iterator[str]: ...

@dataclass
class Reconciliation:
    """What a manifest's recorded samples are to a (possibly other) version of the data: `Manifest.reconcile`."""

    lines: int
    kept: int = 0  # done samples whose line is unchanged, at the same line number
    moves: list[tuple[int, int]] = field(default_factory=list)  # (recorded index, the line's index now)
    dropped: list[int] = field(default_factory=list)  # done samples of lines changed or gone (files deleted)
    failed_dropped: list[int] = field(default_factory=list)  # failed rows of lines changed or gone
    unmatched_legacy: int = 0  # of `dropped`: rows from before line hashes, of another version of the data
    hashed_keys: dict[int, str] = field(default_factory=dict)  # older rows of this very data: their hash

    @property
    def usable(self) -> int:
        """Done samples this data keeps."""
        return self.kept + len(self.moves)

    @property
    def changes(self) -> bool:
        return bool(self.moves or self.dropped or self.failed_dropped or self.hashed_keys)

    def describe(self) -> str:
        """One sentence: what is kept, moved, dropped and left to do."""
        parts = [f"{self.kept:,} kept (lines unchanged)"]
        if self.moves:
            parts.append(f"{len(self.moves):,} moved to their lines' new numbers")
        if self.dropped:
            legacy = (f", {self.unmatched_legacy:,} of them recorded before line hashes were kept and so not "
                      "matchable" if self.unmatched_legacy else "")
            parts.append(f"{len(self.dropped):,} dropped (their lines changed or left the data{legacy}; files "
                         "deleted)")
        return f"{', '.join(parts)}; {self.lines - self.usable:,} of {self.lines:,} lines to do"


class Manifest:
    """The writer's side: one connection owned by the extraction client."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / MANIFEST_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        self.shared = shared_across_hosts(self.path.parent)
        if self.shared:  # read from the controller's host: a rollback journal, each commit durable
            self.conn.execute("PRAGMA journal_mode = DELETE")
            self.conn.execute("PRAGMA synchronous = FULL")
        else:
            self.conn.execute("PRAGMA journal_mode = WAL")
            # Each sample's file is fsync-ed before its row is written; a row lost to a power
            # cut only means that sample is extracted again on resume.
            self.conn.execute("PRAGMA synchronous = NORMAL")
        self.conn.executescript(SCHEMA)
        columns = {r[1] for r in self.conn.execute("PRAGMA table_info(samples)")}
        for column, kind in (("latency_s", "REAL"), ("line_hash", "TEXT"), ("topk_mass", "REAL")):  # older: kept
            if column not in columns:
                self.conn.execute(f"ALTER TABLE samples ADD COLUMN {column} {kind}")

    def meta(self) -> dict[str, str]:
        """All meta key/values."""
        return dict(self.conn.execute("SELECT key, value FROM meta"))

    def set_meta(self, values: dict[str, object]) -> None:
        """Upsert meta values (stored as text)."""
        self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                              [(k, str(v)) for k, v in values.items()])

    def done(self) -> set[int]:
        """Indices recorded as done."""
        return {r[0] for r in self.conn.execute("SELECT idx FROM samples WHERE status = 'done'")}

    def forget(self, indices: list[int]) -> None:
        """Drop rows (a done sample whose file is missing is extracted again)."""
        self.conn.executemany("DELETE FROM samples WHERE idx = ?", [(i,) for i in indices])

    def record(self, *, idx: int, sample_id: str | None, status: str, tokens: int | None, nbytes: int | None,
               attempts: int, error: str | None, now: float, latency_s: float | None = None,
               line_hash: str | None = None, topk_mass: float | None = None) -> None:
        """Record one sample's outcome (replacing an earlier attempt's row)."""
        self.conn.execute(
            "INSERT OR REPLACE INTO samples (idx, id, status, tokens, bytes, attempts, error, finished_at, latency_s, "
            "line_hash, topk_mass) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (idx, sample_id, status, tokens, nbytes, attempts, error, now, latency_s, line_hash, topk_mass))

    def reconcile(self, keys: Keys, *, same_data: bool) -> Reconciliation:
        """Match the recorded samples to the data's lines by content (`keys`: each line's `line_hash`).

        A done sample stays where its line still reads the same; one whose line moved (lines inserted or
        removed above it) moves with it; one whose line changed or left the data is dropped. Rows from before
        line hashes were kept are this data's only when the whole file is the same (`same_data`), and then
        get their hash. Nothing is changed here: `apply` does it."""
        rows = self.conn.execute("SELECT idx, status, line_hash FROM samples").fetchall()
        plan = Reconciliation(lines=len(keys))
        in_place: set[int] = set()  # done samples at their line
        failed_in_place: set[int] = set()
        loose: dict[str, list[int]] = {}  # content key -> done rows not at their line
        for idx, status, key in rows:
            if key is None and same_data and idx < len(keys):
                plan.hashed_keys[idx] = key = keys[idx]
            fits = key is not None and idx < len(keys) and keys[idx] == key
            if fits:
                (in_place if status == "done" else failed_in_place).add(idx)
                plan.kept += status == "done"
            elif status == "done" and key is not None:
                loose.setdefault(key, []).append(idx)
            else:
                (plan.dropped if status == "done" else plan.failed_dropped).append(idx)
                plan.unmatched_legacy += key is None and status == "done"
        for i, key in enumerate(keys):
            if i not in in_place and loose.get(key):
                plan.moves.append((loose[key].pop(), i))
                if i in failed_in_place:  # a failed try of this line gives way to its done sample
                    plan.failed_dropped.append(i)
        plan.dropped += [j for left in loose.values() for j in left]
        return plan

    def apply(self, plan: Reconciliation, path_of: Callable[[int], Path]) -> None:
        """Carry out a reconciliation: drop rows (and files) of lines no longer in the data, move the others'
        files to their new line numbers. Rows go first, in one transaction, so a crash part-way leaves no row
        naming a file of another line: a file that was on its way is extracted again."""
        cols = ("id", "status", "tokens", "bytes", "attempts", "error", "finished_at", "latency_s", "line_hash",
                "topk_mass")
        moving = {j: dict(zip(cols, self.conn.execute(f"SELECT {', '.join(cols)} FROM samples WHERE idx = ?",
                                                      (j,)).fetchone(), strict=True)) for j, _ in plan.moves}
        gone = plan.dropped + plan.failed_dropped + [j for j, _ in plan.moves]
        with self.conn:
            self.conn.execute("BEGIN")
            self.conn.executemany("DELETE FROM samples WHERE idx = ?", [(j,) for j in gone])
            self.conn.executemany("UPDATE samples SET line_hash = ? WHERE idx = ?",
                                  [(k, i) for i, k in plan.hashed_keys.items()])
        for j in plan.dropped:
            Path(path_of(j)).unlink(missing_ok=True)
        for left in Path(path_of(0)).parent.glob(".*.move.tmp"):  # an earlier apply cut short: not counted
            left.unlink(missing_ok=True)
        staged = {}
        for j, _ in plan.moves:  # through temp names first: a move may land where another starts
            src = Path(path_of(j))
            if src.exists():  # a row without its file is simply extracted again
                staged[j] = src.with_name(f".{src.name}.move.tmp")
                src.replace(staged[j])
        for j, i in plan.moves:
            if j in staged:
                staged[j].replace(path_of(i))
        with self.conn:
            self.conn.execute("BEGIN")
            for j, i in plan.moves:
                if j not in staged:
                    continue
                r = moving[j]
                self.record(idx=i, sample_id=r["id"], status=r["status"], tokens=r["tokens"], nbytes=r["bytes"],
                            attempts=r["attempts"], error=r["error"], now=r["finished_at"], latency_s=r["latency_s"],
                            line_hash=r["line_hash"], topk_mass=r["topk_mass"])

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()
