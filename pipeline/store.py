"""The sqlite state store: runs, stage processes, observations, events, audit.

WAL mode with a busy timeout so the service, the CLI and stage runners can share
it. The schema evolves through named, transactional sqlite-utils migrations. A
file that is not a readable eagle3 store is an error and is never recreated:
silently starting over would forget running stages and their evidence.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlite_utils import Database, Migrations

from pipeline.errors import StoreError
from pipeline.states import HandoffState, StageProc
from pipeline.verdict import StoredVerdict

BUSY_TIMEOUT_S = 10.0
migrations = Migrations("eagle3")


@migrations()
def m001_core(db: Database) -> None:
    db.table("runs").create({"id": str, "opened_at": float, "closed_at": float, "close_reason": str}, pk="id")
    db.table("stage_procs").create(
        {
            "id": int, "run_id": str, "stage": str, "state": str, "pid": int, "pgid": int,
            "create_time": float, "runner_pid": int, "runner_create_time": float, "argv": str,
            "log": str, "started_at": float, "ended_at": float, "exit_code": int, "signal": int,
            "stop_requested": int, "reason": str,
        },
        pk="id",
    )
    db.table("stage_procs").create_index(["stage", "id"])
    db.table("events").create({"id": int, "t": float, "run_id": str, "stage": str, "kind": str, "data": str}, pk="id")
    db.table("audit").create(
        {"id": int, "t": float, "user": str, "channel": str, "action": str, "outcome": str, "detail": str}, pk="id"
    )
    db.table("kv").create({"key": str, "value": str}, pk="key")


@migrations()
def m002_observations(db: Database) -> None:
    db.table("observations").create({"id": int, "t": float, "stage": str, "run_id": str, "data": str}, pk="id")
    db.table("observations").create_index(["stage", "t"])


@migrations()
def m003_outbox(db: Database) -> None:
    # A message is stored here before it is sent and marked sent after the chat service accepts it.
    db.table("outbox").create(
        {"id": int, "t": float, "channel": str, "kind": str, "text": str, "blocks": str, "update_key": str,
         "thread_key": str, "status": str, "attempts": int, "next_try": float, "last_error": str, "sent_at": float,
         "ts": str},
        pk="id",
    )
    db.table("outbox").create_index(["status", "id"])


@migrations()
def m004_outbox_update_key(db: Database) -> None:
    # The delivery loop asks every pass whether the open run's status message exists.
    db.table("outbox").create_index(["channel", "update_key"])


@migrations()
def m005_outbox_attachment(db: Database) -> None:
    # A message may carry something to upload (a chart, JSON: what to draw); delivery renders it.
    db.table("outbox").add_column("attachment", str)


@migrations()
def m006_stage_jobs(db: Database) -> None:
    """Stages run by an executor other than the local runner: which one, and the job's name and id."""
    db.table("stage_procs").add_column("executor", str)
    db.table("stage_procs").add_column("job_name", str)
    db.table("stage_procs").add_column("job_id", str)
    db.table("stage_procs").add_column("job_host", str)  # where the job's batch script runs (Slurm's BatchHost)


@migrations()
def m007_restart_state(db: Database) -> None:
    """The restart policy's state on the process row (it was in kv entries): the restarts before this process
    in its line of automatic restarts, when the policy may restart it once it died, and whether it gave up."""
    db.table("stage_procs").add_column("restart_count", int)
    db.table("stage_procs").add_column("restart_due", float)
    db.table("stage_procs").add_column("restart_given_up", int)


@migrations()
def m008_job_follow(db: Database) -> None:
    """What the cluster said of a Slurm job: its state at its end (an interrupted end is told from the stage's own),
    its nodes, how often Slurm requeued it, its time limit and when that limit ends it."""
    db.table("stage_procs").add_column("job_state", str)
    db.table("stage_procs").add_column("job_nodes", str)
    db.table("stage_procs").add_column("job_restarts", int)
    db.table("stage_procs").add_column("job_limit_s", float)
    db.table("stage_procs").add_column("job_end_at", float)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    return conn


CONSOLE_CHANNEL = "console"  # the outbox channel of messages printed by the console transport


OPEN_RETRY_S = 10.0  # how long opening retries a store that another process is creating


def _pk(table) -> int:
    """The row id an insert gave (sqlite always gives one to a rowid table)."""
    pk = table.last_pk
    if pk is None:
        raise sqlite3.DatabaseError("the insert returned no row id")
    return int(pk)


class _Family:
    """A key family: its prefix, then what the entry is about, joined by ':' (`KV.verdict("extract")`)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, *parts: object) -> str:
        return self.prefix + ":".join(str(p) for p in parts)


class KV:
    """Every key of the kv table, spelled once (a key built in two places drifts): callers name a family, never
    write a key.

    Single entries are constants; families are functions of what they are about. The notifier's console
    transport keeps its own copy of its families under a prefix (`Notifier.k`)."""

    FAMILIES: tuple[str, ...] = ()  # every family's prefix (set below, once the class is made)
    MONITOR = "monitor"  # the monitor's heartbeat {pid, t, tick_s}
    TRANSPORT = "transport"  # how serve receives Slack's commands {kind, state, error, since, pid}
    SLACK_AUTH = "slack_auth"  # auth.test's answer {ok, user, team | error}
    GPU_BASELINE = "gpu_baseline"  # each GPU's memory in use before the server started {index: MB}
    REMINDERS = "reminders"  # [{due_at, by, …}] "check back later"
    HANDOFF = "handoff"  # the auto-start handoff's state (pipeline/handoff/machine.py)
    CHART_LATEST = "chart:latest"  # the last chart uploaded {file_id, stage, t, path}
    NOTIFIER_AFTER = "notifier_after"  # the last event the notifier turned into messages
    CHART_SCOPE_NOTED = "chart_scope_noted"  # the missing files:write scope was said once
    CONFIG_CHANGED = "config_changed"  # the config file changed since serve started {t, sha, error, file}

    # families: KV.<name>(*parts) is the prefix and the parts joined by ":" (what each entry is about)
    verdict = _Family("verdict:")  # (stage) the stage's StoredVerdict
    snooze = _Family("snooze:")  # (stage) alerts snoozed until t
    acked = _Family("acked:")  # (stage) who took its alert, and when {by, t}: no escalation for that alert
    condition = _Family("condition:")  # (name, proc_id) a condition alert was raised once
    alerted = _Family("alerted:")  # (stage, cause) an alert's last time
    escalated = _Family("escalated:")  # (stage, alerted_at) the alert's escalation was posted
    milestones = _Family("milestones:")  # (run) the progress milestones posted
    open_alert = _Family("open-alert:")  # (stage) the alert to resolve in place
    ts = _Family("ts:")  # (update_key) the chat service's ts of the message with this update key
    previewed = _Family("previewed:")  # (run) the data's template preview was posted in the run's thread
    step_told = _Family("step-told:")  # (run) the last handoff step told in the run's thread (one reply a step)
    final_status = _Family("final-status:")  # (run) its status post was given its final render
    chain = _Family("chain:")  # (run, "extract") regeneration's extraction started; (run, "refused", proc id) refused
    restarting = _Family("restarting:")  # (stage) a restart by hand under way {of: proc id, t}: its stop is no ending


KV.FAMILIES = tuple(v.prefix for v in vars(KV).values() if isinstance(v, _Family))


class Store:
    """Typed access to the state store; one instance per process."""

    def __init__(self, path: Path, *, clock=time.time, check_integrity: bool = True) -> None:
        """Open (or create) the store. `check_integrity` runs PRAGMA quick_check, a pass over the whole
        file (about a second at a million observations): `serve` does it once at start; the Slack
        request path opens the store with it off, so an ack does not grow with the store."""
        self.path = Path(path)
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + OPEN_RETRY_S
        for attempt in itertools.count():
            existed = self.path.exists() and self.path.stat().st_size > 0
            try:
                self._open(existed, check_integrity)
                return
            except sqlite3.OperationalError as exc:
                # switching a store another process is creating to WAL can answer "locked" at once, without
                # waiting on the busy timeout: try again, briefly
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise self._unusable(exc) from None
                time.sleep(min(0.5, 0.02 * 2 ** attempt))
            except sqlite3.DatabaseError as exc:
                raise self._unusable(exc) from None

    def _open(self, existed: bool, check_integrity: bool) -> None:
        conn = _connect(self.path)
        try:
            if existed:
                self._check_existing(conn, integrity=check_integrity)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            self.db = Database(conn)
            if not existed or migrations.pending(self.db):
                with self.atomic():  # IMMEDIATE: a second process opening a store being created waits for it
                    migrations.apply(self.db)
        except sqlite3.DatabaseError:
            conn.close()
            raise

    def _unusable(self, exc: Exception) -> StoreError:
        return StoreError(f"{self.path}: not a usable eagle3 store ({exc}); move it aside to keep its evidence, "
                          "then run the command again to start a new store")

    def _check_existing(self, conn: sqlite3.Connection, *, integrity: bool) -> None:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "_sqlite_migrations" not in tables:  # none at all: another process is creating it
            raise sqlite3.DatabaseError("it holds no eagle3 schema")
        if integrity and conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("integrity check failed")

    def close(self) -> None:
        """Close the connection."""
        self.db.conn.close()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """One write transaction; IMMEDIATE so that a read-then-write in two processes queues
        on the busy timeout instead of failing to upgrade its lock."""
        conn = self.db.conn
        if conn.in_transaction:
            with self.db.atomic():
                yield
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # --- kv -----------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A JSON value from the kv table."""
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", [key]).fetchone()
        return json.loads(row[0]) if row else default

    def get_many(self, keys: list[str]) -> dict[str, Any]:
        """The JSON values of `keys` in one read (a key without one is absent)."""
        marks = ",".join("?" * len(keys))
        rows = self.db.execute(f"SELECT key, value FROM kv WHERE key IN ({marks})", keys).fetchall()
        return {k: json.loads(v) for k, v in rows}

    def put(self, key: str, value: Any) -> None:
        """Store a JSON value in the kv table."""
        self.db.table("kv").upsert({"key": key, "value": json.dumps(value)}, pk="key")

    # --- the handoff ----------------------------------------------------------
    def handoff(self) -> HandoffState | None:
        """The stored auto-start handoff, whatever its run (pipeline/handoff/machine.handoff_state is the open
        run's view of it)."""
        return HandoffState.from_json(self.get(KV.HANDOFF))

    def put_handoff(self, state: HandoffState) -> None:
        self.put(KV.HANDOFF, state.to_json())

    # --- verdicts -----------------------------------------------------------
    def verdict(self, stage: str) -> StoredVerdict | None:
        """The stage's latest stored verdict (pipeline/verdict.StoredVerdict), or None."""
        return StoredVerdict.from_json(self.get(KV.verdict(stage)))

    def put_verdict(self, stage: str, record: StoredVerdict) -> None:
        """Store the stage's latest verdict."""
        self.put(KV.verdict(stage), record.to_json())

    # --- runs ---------------------------------------------------------------
    def open_run(self) -> str:
        """The open run's id, opening a new run when none is open."""
        with self.atomic():
            row = self.db.execute("SELECT id FROM runs WHERE closed_at IS NULL ORDER BY opened_at DESC LIMIT 1").fetchone()
            if row:
                return row[0]
            now = self.clock()
            run_id = "r" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
            if self.db.execute("SELECT 1 FROM runs WHERE id = ?", [run_id]).fetchone():
                run_id += f"-{int(now * 1000) % 1000:03d}"
            self.db.table("runs").insert({"id": run_id, "opened_at": now})
            self.add_event(kind="run-opened", run_id=run_id)
            return run_id

    def current_run(self) -> str | None:
        """The open run's id, or None."""
        row = self.db.execute("SELECT id FROM runs WHERE closed_at IS NULL ORDER BY opened_at DESC LIMIT 1").fetchone()
        return row[0] if row else None

    def latest_run(self) -> str | None:
        """The open run's id, or else the most recent closed one."""
        row = self.db.execute("SELECT id FROM runs ORDER BY closed_at IS NULL DESC, opened_at DESC LIMIT 1").fetchone()
        return row[0] if row else None

    def last_closed_run(self) -> tuple[str, str | None, float] | None:
        """(id, why it closed, when) of the most recently closed run, or None."""
        row = self.db.execute("SELECT id, close_reason, closed_at FROM runs WHERE closed_at IS NOT NULL "
                              "ORDER BY closed_at DESC, opened_at DESC LIMIT 1").fetchone()
        return (row[0], row[1], row[2]) if row else None

    def reopen_run(self, run_id: str, *, reason: str) -> None:
        """Open a closed run again (training started on its verified extraction, with no run open)."""
        with self.atomic():
            self.db.execute("UPDATE runs SET closed_at = NULL, close_reason = NULL WHERE id = ?", [run_id])
            self.add_event(kind="run-reopened", run_id=run_id, data={"reason": reason})

    def close_run(self, run_id: str, *, reason: str) -> None:
        """Close a run (training ended, or everything stopped)."""
        self.db.execute("UPDATE runs SET closed_at = ?, close_reason = ? WHERE id = ? AND closed_at IS NULL",
                        [self.clock(), reason, run_id])
        self.add_event(kind="run-closed", run_id=run_id, data={"reason": reason})

    # --- stage processes ----------------------------------------------------
    def insert_proc(self, row: dict) -> int:
        """Record a new stage process; returns its row id."""
        return _pk(self.db.table("stage_procs").insert(row))

    def update_proc(self, proc_id: int, **fields: Any) -> None:
        """Update fields of one stage-process row."""
        self.db.table("stage_procs").update(proc_id, fields)

    def row(self, proc_id: int) -> StageProc:
        """The stage-process row `proc_id`, which the caller knows exists (it made it, or holds it): a missing one is
        a LookupError, never None."""
        proc = self.proc(proc_id)
        if proc is None:
            raise LookupError(f"no stage-process row {proc_id} in {self.path}")
        return proc

    def proc(self, proc_id: int) -> StageProc | None:
        """One stage-process row by id."""
        rows = list(self.db.table("stage_procs").rows_where("id = ?", [proc_id]))
        return StageProc.from_row(rows[0]) if rows else None

    def latest_proc(self, stage: str, *, run: str | None = None) -> StageProc | None:
        """The most recent process row of a stage (of one run, with `run`)."""
        where, args = ("stage = ?", [stage]) if run is None else ("stage = ? AND run_id = ?", [stage, run])
        rows = self._proc_rows(f"SELECT * FROM stage_procs WHERE {where} ORDER BY id DESC LIMIT 1", args)
        return rows[0] if rows else None

    def latest_procs(self) -> dict[str, StageProc]:
        """Each stage's most recent process row, in one read."""
        return {p.stage: p for p in self._proc_rows(
            "SELECT * FROM stage_procs WHERE id IN (SELECT MAX(id) FROM stage_procs GROUP BY stage)", [])}

    def _proc_rows(self, sql: str, args: list) -> list[StageProc]:
        cur = self.db.execute(sql, args)
        cols = [c[0] for c in cur.description]
        return [StageProc.from_row(dict(zip(cols, r, strict=True))) for r in cur.fetchall()]

    def procs(self, stage: str, *, after: int = 0) -> list[StageProc]:
        """A stage's process rows with an id above `after`, oldest first."""
        return [StageProc.from_row(r) for r in
                self.db.table("stage_procs").rows_where("stage = ? AND id > ?", [stage, after], order_by="id")]

    # --- observations ---------------------------------------------------------
    def add_observation(self, obs: dict, *, run_id: str | None) -> None:
        """Store one observation (the replay format)."""
        self.db.table("observations").insert({"t": obs["t"], "stage": obs["stage"], "run_id": run_id, "data": json.dumps(obs)})

    def latest_observation(self, stage: str) -> dict | None:
        """The newest observation of a stage."""
        row = self.db.execute("SELECT data FROM observations WHERE stage = ? ORDER BY t DESC LIMIT 1", [stage]).fetchone()
        return json.loads(row[0]) if row else None

    def observations(self, *, stage: str | None = None, since: float | None = None,
                     run: str | None = None) -> Iterator[dict]:
        """Observations in time order, optionally of one stage, one run, and since a time."""
        where, args = ["1"], list[object]()
        if run:
            where, args = where + ["run_id = ?"], args + [run]
        if stage:
            where, args = where + ["stage = ?"], args + [stage]
        if since is not None:
            where, args = where + ["t >= ?"], args + [since]
        for (data,) in self.db.execute(f"SELECT data FROM observations WHERE {' AND '.join(where)} ORDER BY t, id", args):
            yield json.loads(data)

    def thin_observations(self, *, now: float, keep_all_s: float = 86400.0, bucket_s: float = 60.0) -> int:
        """Keep every observation of the last day; older ones one per stage per `bucket_s`.

        Incremental: each pass thins only what aged past the day since the last pass (kv
        `thinned_until`, whole buckets, through the (stage, t) index), so its cost does not grow
        with the store."""
        hi = (now - keep_all_s) // bucket_s * bucket_s
        lo = float(self.get("thinned_until", float("-inf")))
        if hi <= lo:
            return 0
        removed = 0
        with self.atomic():
            for (stage,) in self.db.execute("SELECT DISTINCT stage FROM observations").fetchall():
                cur = self.db.execute(
                    "DELETE FROM observations WHERE stage = ? AND t >= ? AND t < ? AND id NOT IN ("
                    "SELECT MIN(id) FROM observations WHERE stage = ? AND t >= ? AND t < ? "
                    "GROUP BY CAST(t / ? AS INTEGER))", [stage, lo, hi, stage, lo, hi, bucket_s])
                removed += cur.rowcount
            self.put("thinned_until", hi)
        return removed

    # --- outbox -------------------------------------------------------------------
    def enqueue(self, *, channel: str, kind: str, text: str, blocks: list | None = None,
                update_key: str | None = None, thread_key: str | None = None,
                attachment: dict | None = None) -> int:
        """Store an outgoing message (delivered in id order per channel). `thread_key` is an update
        key whose message the reply goes under, or `outbox:ID` (the reply goes under that message);
        `attachment` says what to upload with it (`{"chart": stage, ...}`), rendered at delivery."""
        if kind == "status" and update_key:  # a newer status replaces one not yet delivered: one edit, the latest
            row = self.db.execute("SELECT id FROM outbox WHERE status = 'pending' AND kind = 'status' AND channel = ? "
                                  "AND update_key = ? ORDER BY id DESC LIMIT 1", [channel, update_key]).fetchone()
            if row:
                self.db.table("outbox").update(row[0], {"text": text, "blocks": json.dumps(blocks or []), "t": self.clock()})
                return row[0]
        return _pk(self.db.table("outbox").insert({
            "t": self.clock(), "channel": channel, "kind": kind, "text": text, "blocks": json.dumps(blocks or []),
            "update_key": update_key, "thread_key": thread_key, "status": "pending", "attempts": 0,
            "next_try": 0.0, "attachment": json.dumps(attachment) if attachment else None}))

    def message_ts(self, message_id: int) -> str | None:
        """The chat service's ts of a delivered outbox message (None while it is pending)."""
        row = self.db.execute("SELECT ts FROM outbox WHERE id = ? AND status = 'sent'", [message_id]).fetchone()
        return row[0] if row else None

    def pending_messages(self, channel: str | None = None) -> list[dict]:
        """Undelivered messages (to one channel, or all), oldest first."""
        where, args = ("status = 'pending'", []) if channel is None else ("status = 'pending' AND channel = ?", [channel])
        return list(self.db.table("outbox").rows_where(where, args, order_by="id"))

    def has_message(self, *, channel: str, update_key: str) -> bool:
        """True when a message with this update key was ever enqueued to `channel`."""
        return self.db.execute("SELECT 1 FROM outbox WHERE channel = ? AND update_key = ? LIMIT 1",
                               [channel, update_key]).fetchone() is not None

    def mark_sent(self, message_id: int, *, ts: str | None) -> None:
        """Slack accepted the message (its ts is what later updates and thread replies use)."""
        self.db.table("outbox").update(message_id, {"status": "sent", "sent_at": self.clock(), "ts": ts})

    def mark_failed(self, message_id: int, *, attempts: int, error: str, retry: bool, next_try: float) -> None:
        """A delivery attempt failed: pending again from `next_try`, or failed for good."""
        self.db.table("outbox").update(message_id, {"attempts": attempts, "last_error": error,
                                              "status": "pending" if retry else "failed", "next_try": next_try})

    def outbox_summary(self) -> dict:
        """Counts of pending and failed outgoing messages, with the newest error (for `eagle3 status`)."""
        pending, failed, last = self.db.execute(
            "SELECT SUM(status = 'pending'), SUM(status = 'failed'), (SELECT last_error FROM outbox WHERE last_error "
            "IS NOT NULL AND status != 'sent' AND channel != ? ORDER BY id DESC LIMIT 1) FROM outbox WHERE channel != ?",
            [CONSOLE_CHANNEL, CONSOLE_CHANNEL]).fetchone()
        return {"pending": pending or 0, "failed": failed or 0, "last_error": last}

    # --- events and audit ---------------------------------------------------
    def add_event(self, *, kind: str, run_id: str | None = None, stage: str | None = None, data: dict | None = None) -> int:
        """Append an event (state changes, exits, handoff steps, actions)."""
        return _pk(self.db.table("events").insert(
            {"t": self.clock(), "run_id": run_id, "stage": stage, "kind": kind, "data": json.dumps(data or {})}
        ))

    def recent_events(self, limit: int) -> list[dict]:
        """The newest `limit` events, oldest first, with data decoded."""
        rows = self.db.execute("SELECT * FROM events ORDER BY id DESC LIMIT ?", [limit])
        cols = [c[0] for c in rows.description]
        out = [dict(zip(cols, r, strict=True)) for r in rows.fetchall()]
        return [dict(r, data=json.loads(r["data"])) for r in reversed(out)]

    def events(self, *, after_id: int = 0, kind: str | None = None) -> list[dict]:
        """Events after an id, oldest first, with data decoded."""
        where, args = "id > ?", list[object]([after_id])
        if kind:
            where, args = where + " AND kind = ?", args + [kind]
        return [dict(r, data=json.loads(r["data"])) for r in self.db.table("events").rows_where(where, args, order_by="id")]

    def last_choice(self, actions: list[str], *, run: str) -> dict | None:
        """The newest audit row of one of `actions` done while `run` was open (who chose what on its status post)."""
        row = self.db.execute(
            f"SELECT a.t, a.user, a.action, a.detail FROM audit a JOIN runs r ON r.id = ? WHERE a.outcome = 'done' "
            f"AND a.action IN ({', '.join('?' * len(actions))}) AND a.t >= r.opened_at ORDER BY a.id DESC LIMIT 1",
            [run, *actions]).fetchone()
        return dict(zip(("t", "user", "action", "detail"), row, strict=True)) if row else None

    def audit(self, *, user: str, channel: str | None, action: str, outcome: str, detail: str = "") -> None:
        """Record an action, allowed or refused."""
        self.db.table("audit").insert(
            {"t": self.clock(), "user": user, "channel": channel, "action": action, "outcome": outcome, "detail": detail}
        )


_threads = threading.local()


def thread_store(path: Path) -> Store:
    """This thread's connection to the store at `path`, opened once and kept (without the integrity check: the
    service checked the store once at start). The service's delivery passes and Bolt's listener threads each
    reuse theirs instead of opening the store again; the one cache of connections."""
    stores = getattr(_threads, "stores", None)
    if stores is None:
        stores = _threads.stores = {}
    store = stores.get(path)
    if store is None:
        store = stores[path] = Store(path, check_integrity=False)
    return store
