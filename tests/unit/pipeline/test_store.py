"""The state store: migrations, WAL, corrupt files, runs."""

import sqlite3
from pathlib import Path

import pytest
from sqlite_utils import Database

from pipeline.errors import StoreError
from pipeline.store import Store, migrations


def test_new_store_is_wal_with_all_migrations(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert [m.name for m in migrations.applied(store.db)] == [m.name for m in migrations._migrations]
    assert {"runs", "stage_procs", "observations", "events", "audit", "kv"} <= set(store.db.table_names())


def test_older_schema_migrates_in_place(tmp_path):
    path = tmp_path / "s.sqlite"
    db = Database(path)
    migrations.apply(db, stop_before="m002_observations")
    db["runs"].insert({"id": "r-old", "opened_at": 1.0})
    db.conn.close()
    store = Store(path)
    assert "observations" in store.db.table_names()
    assert store.current_run() == "r-old"


@pytest.mark.parametrize("content", [b"this is not sqlite" * 100, b"SQLite format 3\x00" + b"\xff" * 4000])
def test_corrupt_file_is_a_clear_error_and_kept(tmp_path, content):
    path = tmp_path / "s.sqlite"
    path.write_bytes(content)
    with pytest.raises(StoreError, match="not a usable eagle3 store") as err:
        Store(path)
    assert "\n" not in str(err.value)
    assert path.read_bytes() == content


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE other (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="no eagle3 schema"):
        Store(path)


def test_runs_open_once_and_close(tmp_path):
    store = Store(tmp_path / "s.sqlite", clock=lambda: 1_790_000_000.0)
    run = store.open_run()
    assert store.open_run() == run
    store.close_run(run, reason="done")
    assert store.current_run() is None
    second = store.open_run()
    assert second != run
    kinds = [e["kind"] for e in store.events()]
    assert kinds == ["run-opened", "run-closed", "run-opened"]


def test_atomic_rolls_back(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    with pytest.raises(RuntimeError), store.atomic():
        store.put("k", 1)
        raise RuntimeError
    assert store.get("k") is None


def test_integrity_check_only_where_asked(tmp_path, monkeypatch):
    import pipeline.store as store_mod

    Store(tmp_path / "s.sqlite").close()
    seen: list[str] = []
    real = store_mod._connect

    def traced(path):
        conn = real(path)
        conn.set_trace_callback(seen.append)
        return conn

    monkeypatch.setattr(store_mod, "_connect", traced)
    Store(tmp_path / "s.sqlite", check_integrity=False).close()  # the Slack request path
    assert not any("quick_check" in s for s in seen)
    Store(tmp_path / "s.sqlite").close()  # serve's start, the CLI
    assert any("quick_check" in s for s in seen)


def test_thinning_is_incremental_and_keeps_one_per_bucket(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    t0, day = 1_790_000_000.0, 86400.0
    ticks = [t0 + 10 * i for i in range(3 * 8640)]  # three days at 10 s, two stages
    for stage in ("extract", "train"):
        store.db["observations"].insert_all({"t": t, "stage": stage, "data": "{}"} for t in ticks)

    def times(stage="extract"):
        return [r[0] for r in store.db.execute("SELECT t FROM observations WHERE stage = ? ORDER BY t", [stage])]

    def check(now):
        cut = (now - day) // 60 * 60
        old, recent = [t for t in times() if t < cut], [t for t in times() if t >= cut]
        assert len(old) == len({int(t // 60) for t in ticks if t < cut})  # one per minute…
        assert len({int(t // 60) for t in old}) == len(old)  # …and only one
        assert recent == [t for t in ticks if t >= cut]  # the last day untouched

    assert store.thin_observations(now=t0 + 2 * day) > 0
    check(t0 + 2 * day)
    assert store.thin_observations(now=t0 + 2 * day) == 0  # nothing new aged past the day: nothing done
    assert store.thin_observations(now=t0 + 3 * day) > 0
    check(t0 + 3 * day)
    assert times("train") == times("extract")
    store.close()


def _open_at(path: str, start, errors) -> None:
    start.wait()
    try:
        Store(Path(path)).close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        errors.put(f"{type(exc).__name__}: {exc}")


def test_processes_opening_a_new_store_at_once_all_get_it(tmp_path):
    """`eagle3 serve` creating the store while a CLI command opens it (the Slurm kill -9 test saw
    'it holds no eagle3 schema'): the first creates it in one IMMEDIATE transaction, the others wait."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for round_ in range(8):
        path, start, errors = tmp_path / f"s{round_}.sqlite", ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_open_at, args=(str(path), start, errors)) for _ in range(4)]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(30)
        found = [errors.get(timeout=1) for _ in range(errors.qsize())] if not errors.empty() else []
        assert found == [] and all(p.exitcode == 0 for p in procs), (round_, found)
        store = Store(path)
        assert {m.name for m in migrations.applied(store.db)} == {m.name for m in migrations.pending(Database(
            sqlite3.connect(":memory:")))}
        store.close()


def test_every_key_family_is_named_once_and_kept_apart(tmp_path):
    """Each kv family has one name in the store (KV); every one round-trips and no two collide."""
    from pipeline.store import KV, _Family

    singles = {name: v for name, v in vars(KV).items() if name.isupper() and isinstance(v, str)}
    families = {name: fn for name, fn in vars(KV).items() if isinstance(fn, _Family)}
    keys = dict(singles)
    for name, fn in families.items():
        key = fn("a")
        assert key.split(":", 1)[0] + ":" in KV.FAMILIES, (name, key)
        keys[name] = key
    assert len(set(keys.values())) == len(keys) == len(singles) + len(families)
    assert {k.split(":", 1)[0] + ":" for n, k in keys.items() if n in families} == set(KV.FAMILIES)
    store = Store(tmp_path / "s.sqlite")
    try:
        for i, key in enumerate(keys.values()):
            store.put(key, {"i": i})
        assert [store.get(k) for k in keys.values()] == [{"i": i} for i in range(len(keys))]
    finally:
        store.close()
