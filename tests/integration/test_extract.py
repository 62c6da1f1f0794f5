"""Extraction against the toy server over real HTTP on loopback."""

from __future__ import annotations

import http.server
import json
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, eagle3, wait_for
from tests.toy import ToyServer, write_dataset

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def toy():
    server = ToyServer()
    yield server
    server.stop()


def manifest_rows(out: Path) -> dict[int, tuple]:
    conn = sqlite3.connect(out / "manifest.sqlite")
    rows = {r[0]: r[1:] for r in conn.execute("SELECT idx, status, tokens, attempts, error FROM samples")}
    conn.close()
    return rows


def rows_so_far(out: Path) -> int:
    """Manifest rows of a running extraction: 0 until its manifest and table exist."""
    try:
        return len(manifest_rows(out)) if (out / "manifest.sqlite").exists() else 0
    except sqlite3.OperationalError:  # created, not yet migrated
        return 0


def assert_complete(out: Path, samples: list) -> None:
    """Every good sample done exactly once with a valid file; malformed ones failed; nothing else on disk."""
    rows = manifest_rows(out)
    assert sorted(rows) == list(range(len(samples)))
    files = sorted(p.name for p in (out / "hidden_states").iterdir())
    good = [i for i, s in enumerate(samples) if s is not None]
    assert files == sorted(f"hs_{i}.safetensors" for i in good), "temp, partial or extra files on disk"
    for i, ids in enumerate(samples):
        if ids is None:
            assert rows[i][0] == "failed" and f"data line {i + 1}" in rows[i][3]
            continue
        assert rows[i][0] == "done" and rows[i][1] == len(ids)
        t = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert t["token_ids"].tolist() == ids
        assert tuple(t["hidden_states"].shape) == (len(ids), 4, 64)


def spawn_extract(url, data, out, *extra) -> subprocess.Popen:
    """The extraction client as a background process (stderr captured as text)."""
    return subprocess.Popen([sys.executable, "-m", "bot.cli", "extract", "--server", url, "--data", str(data),
                             "--out", str(out), *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def run_extract(url, data, out, *extra, timeout=150):
    return eagle3("extract", "--server", url, "--data", str(data), "--out", str(out), *extra, timeout=timeout)


def test_few_hundred_samples_load_and_match(toy, tmp_path):
    samples = write_dataset(tmp_path / "d.jsonl", 300, bad_lines=(7,))
    res = run_extract(toy.url, tmp_path / "d.jsonl", tmp_path / "out", "--concurrency", "8")
    assert res.returncode == 0, res.stderr
    assert "version 0.5.23-toy, 4 layers per row (3 aux + final)" in res.stderr
    assert_complete(tmp_path / "out", samples)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "hidden_states" / "hs_0.safetensors"), "pt") as f:
        m = f.metadata()
    # the server's default capture: reported as null, recorded as none, in the server's convention (issue 32)
    assert m["final_layer"] == "present" and json.loads(m["layer_ids"]) == [] and m["id"] == "s0"
    assert m["layer_convention"] == "sglang-server-ids"
    assert eagle3("verify", str(tmp_path / "out"), "--sample", "50").returncode == 0


def _workers(proc) -> set[int]:
    """The parse workers of a running client (its `python -m pipeline.extract.parse_worker` children)."""
    try:
        return {c.pid for c in psutil.Process(proc.pid).children() if "pipeline.extract.parse_worker" in c.cmdline()}
    except psutil.Error:
        return set()


def test_kill_9_mid_run_then_resume_loses_nothing(tmp_path):
    # Also: a parse worker killed mid-run is replaced and its sample tried again; the workers die with
    # a client killed by SIGKILL; a run resumed with the client's threads picks up what the workers wrote.
    server = ToyServer("--latency-ms", "20")
    try:
        samples = write_dataset(tmp_path / "d.jsonl", 200, seed=1)
        out = tmp_path / "out"
        proc = spawn_extract(server.url, tmp_path / "d.jsonl", out, "--concurrency", "4", "--parse-workers", "2")
        try:
            wait_for(lambda: rows_so_far(out) >= 20 and len(_workers(proc)) == 2, timeout=60, what="20 samples")
            first = _workers(proc)
            victim = min(first)
            psutil.Process(victim).kill()
            wait_for(lambda: rows_so_far(out) >= 40 and len(_workers(proc) - first) == 1, timeout=60,
                     what="40 samples and a new parse worker")
            workers = _workers(proc)
        finally:
            proc.kill()
            proc.wait()
        _, alive = psutil.wait_procs([psutil.Process(w) for w in workers if psutil.pid_exists(w)], timeout=10)
        assert not alive, "parse workers outlived their client"
        assert f"parse worker {victim} was killed by SIGKILL" in proc.stderr.read()
        partial = len(manifest_rows(out))
        assert partial < 200
        res = run_extract(server.url, tmp_path / "d.jsonl", out, "--concurrency", "4", "--parse-workers", "0")
        assert res.returncode == 0, res.stderr
        assert f"resuming: {partial:,} of 200" in res.stderr or "resuming:" in res.stderr
        assert_complete(out, samples)
    finally:
        server.stop()


def test_parse_workers_write_what_the_client_threads_write(toy, tmp_path):
    from safetensors import safe_open

    write_dataset(tmp_path / "d.jsonl", 40, seed=12, bad_lines=(5,))
    runs = {n: run_extract(toy.url, tmp_path / "d.jsonl", tmp_path / f"w{n}", "--concurrency", "4",
                           "--parse-workers", str(n)) for n in (0, 2)}
    assert all(r.returncode == 0 for r in runs.values()), runs
    assert "in 4 threads of the client" in runs[0].stderr and "in 2 worker process(es)" in runs[2].stderr
    names = sorted(p.name for p in (tmp_path / "w0" / "hidden_states").iterdir())
    assert len(names) == 39 and names == sorted(p.name for p in (tmp_path / "w2" / "hidden_states").iterdir())
    for name in names:
        a, b = (safe_open(str(tmp_path / w / "hidden_states" / name), "pt") for w in ("w0", "w2"))
        assert a.metadata() == b.metadata() and a.keys() == b.keys()
        for k in a.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and x.shape == y.shape and x.view(-1).view(torch.uint8).equal(
                y.view(-1).view(torch.uint8)), (name, k)
    assert manifest_rows(tmp_path / "w0") == manifest_rows(tmp_path / "w2")
    from pipeline.manifest import summarize
    from pipeline.observe.latency import LatencyProfile

    for w in ("w0", "w2"):  # both paths time each request; the manifest's latency profile counts them all
        conn = sqlite3.connect(tmp_path / w / "manifest.sqlite")
        lat = [r[0] for r in conn.execute("SELECT latency_s FROM samples WHERE status = 'done'")]
        conn.close()
        assert len(lat) == 39 and all(x is not None and x > 0 for x in lat), lat
        prof = LatencyProfile.from_bins(summarize(tmp_path / w)["latency_bins"])
        assert prof.samples == 39 and abs(sum(m.sum_s_tokens for m in prof.bins.values()) - sum(lat)) < 1e-6


def test_server_crash_and_restart_mid_run(tmp_path):
    server = ToyServer("--crash-after", "60")
    samples = write_dataset(tmp_path / "d.jsonl", 150, seed=2)
    out = tmp_path / "out"
    proc = spawn_extract(server.url, tmp_path / "d.jsonl", out, "--concurrency", "4", "--server-wait", "60")
    try:
        server.proc.wait(timeout=60)  # it crashes on request 61
        time.sleep(1.0)
        server.stop()
        restarted = ToyServer(port=server.port)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert_complete(out, samples)
        assert max(r[2] for r in manifest_rows(out).values()) <= 2, "an unreachable server must not burn retries"
    finally:
        if proc.poll() is None:
            proc.kill()
        restarted.stop() if "restarted" in locals() else server.stop()


def test_truncation_is_rejected_with_its_cause(tmp_path):
    server = ToyServer("--chunked-prefill-size", "100")
    try:
        samples = write_dataset(tmp_path / "d.jsonl", 20, seed=3, lo=50, hi=160)
        res = run_extract(server.url, tmp_path / "d.jsonl", tmp_path / "out")
        assert res.returncode == 0, res.stderr
        assert "--chunked-prefill-size 100 is below the longest sample" in res.stderr
        rows = manifest_rows(tmp_path / "out")
        for i, ids in enumerate(samples):
            if len(ids) > 100:
                assert rows[i][0] == "failed" and rows[i][2] == 2
                assert f"--chunked-prefill-size ≥ {len(ids)} (now 100)" in rows[i][3]
                assert not (tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors").exists()
            else:
                assert rows[i][0] == "done"
    finally:
        server.stop()


def test_garbage_answers_are_retried_then_failed(tmp_path):
    server = ToyServer("--wrong-rows-every", "1")
    try:
        write_dataset(tmp_path / "d.jsonl", 3, seed=4)
        res = run_extract(server.url, tmp_path / "d.jsonl", tmp_path / "out", "--max-retries", "2")
        assert res.returncode == 0
        rows = manifest_rows(tmp_path / "out")
        assert all(r[0] == "failed" and r[2] == 3 and "hidden-state rows for" in r[3] for r in rows.values())
    finally:
        server.stop()


def test_concurrency_is_held_and_a_memory_budget_below_one_answer_runs_them_alone(tmp_path):
    server = ToyServer("--latency-ms", "400", "--fixed-reply")  # wide enough for 8 to overlap on a busy machine
    try:
        write_dataset(tmp_path / "d.jsonl", 64, seed=5)
        res = run_extract(server.url, tmp_path / "d.jsonl", tmp_path / "out", "--concurrency", "8")
        assert res.returncode == 0 and "in-flight memory budget" in res.stderr
        assert server.metric("toy:max_running_reqs") == 8
        # 1 kB: every answer is larger than the whole budget. One at a time, each named once, no deadlock.
        server.stop()
        server = ToyServer("--latency-ms", "50", "--fixed-reply")
        write_dataset(tmp_path / "s.jsonl", 12, seed=6)
        res = run_extract(server.url, tmp_path / "s.jsonl", tmp_path / "small", "--concurrency", "8",
                          "--max-inflight-gb", "0.000001")
        assert res.returncode == 0, res.stderr
        assert server.metric("toy:max_running_reqs") == 1
        alone = [line for line in res.stderr.splitlines() if "runs alone" in line]
        assert len(alone) == 11 and len({line.split()[3] for line in alone}) == 11, alone  # all but the first
        assert "in-flight memory budget 1.0 kB: a request is sent" in res.stderr
        assert sorted(manifest_rows(tmp_path / "small")) == list(range(12))
    finally:
        server.stop()


class _InfoHandler(http.server.BaseHTTPRequestHandler):
    info: dict = {}

    def do_GET(self):  # noqa: N802
        body = json.dumps(_InfoHandler.info).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.mark.parametrize(("info", "expected"), [
    ({"version": "0.5.23"}, ["--enable-return-hidden-states", "only the final layer"]),
    ({"version": "0.5.23", "enable_return_hidden_states": True}, ["only the final layer"]),
])
def test_preflight_refuses_before_any_sample(tmp_path, info, expected):
    _InfoHandler.info = info
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _InfoHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        write_dataset(tmp_path / "d.jsonl", 3)
        res = run_extract(f"http://127.0.0.1:{srv.server_address[1]}", tmp_path / "d.jsonl", tmp_path / "out")
        assert res.returncode == 2
        assert res.stderr.startswith("eagle3: server refused by preflight:")
        for phrase in expected:
            assert phrase in res.stderr
        assert not (tmp_path / "out").exists()
        assert "Traceback" not in res.stderr
    finally:
        srv.shutdown()
        srv.server_close()


def test_disk_full_injected_is_clear_and_resumable(toy, tmp_path, monkeypatch):
    from pipeline.errors import UserError
    from pipeline.extract import writer
    from pipeline.extract.client import Options, extract

    samples = write_dataset(tmp_path / "d.jsonl", 40, seed=6)
    real_save, calls = writer.serialize_file, {"n": 0}

    def full(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] > 15:  # exactly what safetensors raises on a full disk
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "serialize_file", full)
    # injected in this process, so stored by the client's threads (the parse workers meet a real full disk below)
    opts = Options(server=toy.url, data=tmp_path / "d.jsonl", out=tmp_path / "out", concurrency=2, parse_workers=0)
    with pytest.raises(UserError, match="No space left on device; free space"):
        extract(opts)
    rows = manifest_rows(tmp_path / "out")
    assert 0 < len(rows) < 40 and all(r[0] == "done" for r in rows.values())
    files = sorted(p.name for p in (tmp_path / "out" / "hidden_states").iterdir())
    assert files == sorted(f"hs_{i}.safetensors" for i in rows), "every file counted, no temp files"
    monkeypatch.setattr(writer, "serialize_file", real_save)  # space freed
    assert extract(opts) == 0
    assert_complete(tmp_path / "out", samples)


def test_disk_full_on_a_real_small_filesystem(toy, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        write_dataset(tmp_path / "d.jsonl", 60, seed=7, lo=150, hi=200)
        res = run_extract(toy.url, tmp_path / "d.jsonl", mnt / "out", "--dtype", "fp32")
        # the filesystem fills on a hidden-state file or, as often, on the manifest's own write (sqlite's words)
        assert res.returncode == 2 and re.search(r"(No space left on device|database or disk is full); free space",
                                                 res.stderr), res.stderr
        assert "Traceback" not in res.stderr
        # sqlite cannot open a WAL database on a full filesystem (no room for -shm): grow it first.
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        rows = manifest_rows(mnt / "out")
        files = sorted(p.name for p in (mnt / "out" / "hidden_states").iterdir())
        assert all(r[0] == "done" for r in rows.values())
        assert files == sorted(f"hs_{i}.safetensors" for i in rows), "every file counted, no temp files"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_manifest_write_failure_leaves_no_uncounted_file(toy, tmp_path, monkeypatch):
    """The file is renamed into place, then its manifest row cannot be written (the database's
    disk is full): the file is removed, the run ends with one clear line, and a rerun completes."""
    from pipeline.errors import UserError
    from pipeline.extract.client import Options, extract
    from pipeline.manifest import Manifest

    samples = write_dataset(tmp_path / "d.jsonl", 30, seed=10)
    real_record, calls = Manifest.record, {"n": 0}

    def full(self, **kw):
        calls["n"] += 1
        if calls["n"] > 12:
            raise sqlite3.OperationalError("database or disk is full")
        return real_record(self, **kw)

    monkeypatch.setattr(Manifest, "record", full)
    opts = Options(server=toy.url, data=tmp_path / "d.jsonl", out=tmp_path / "out", concurrency=4)
    # a full disk named as the file writes name it (what the drills' alert looks for), sqlite's words kept
    full_disk = r"cannot record sample \d+ in .*manifest.sqlite: No space left on device \(sqlite: database or disk is full\)"
    with pytest.raises(UserError, match=full_disk + "; free space"):
        extract(opts)
    rows = manifest_rows(tmp_path / "out")
    assert len(rows) == 12
    files = sorted(p.name for p in (tmp_path / "out" / "hidden_states").iterdir())
    assert files == sorted(f"hs_{i}.safetensors" for i in rows)
    monkeypatch.setattr(Manifest, "record", real_record)
    assert extract(opts) == 0
    assert_complete(tmp_path / "out", samples)


def test_sigterm_finishes_cleanly_and_resumes(tmp_path):
    server = ToyServer("--latency-ms", "30")
    try:
        samples = write_dataset(tmp_path / "d.jsonl", 120, seed=8)
        out = tmp_path / "out"
        proc = spawn_extract(server.url, tmp_path / "d.jsonl", out, "--concurrency", "4")
        try:
            wait_for(lambda: rows_so_far(out) >= 20, timeout=60, what="20 samples")
        except AssertionError:
            proc.kill()
            raise
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped on request" in err
        assert len(manifest_rows(out)) < 120
        assert run_extract(server.url, tmp_path / "d.jsonl", out).returncode == 0
        assert_complete(out, samples)
    finally:
        server.stop()


def test_unexpected_worker_error_ends_the_run_instead_of_hanging(toy, tmp_path, monkeypatch):
    from pipeline.errors import UserError
    from pipeline.extract import storing
    from pipeline.extract.client import Options, extract

    write_dataset(tmp_path / "d.jsonl", 30, seed=9)

    def broken(*a, **k):
        raise NameError("write_sample")  # what a broken release once did

    monkeypatch.setattr(storing, "write_sample", broken)
    t = time.monotonic()
    with pytest.raises(UserError, match="unexpected error storing sample .*NameError"):
        extract(Options(server=toy.url, data=tmp_path / "d.jsonl", out=tmp_path / "out", concurrency=4,
                        parse_workers=0))
    assert time.monotonic() - t < 30
    assert manifest_rows(tmp_path / "out") == {}


def test_force_into_an_edited_dataset_keeps_only_lines_that_read_the_same(toy, tmp_path):
    """A partly edited dataset (a line removed, one changed, two added) in a used `--out`: without --force it is
    refused, saying what --force would do; with it, every unchanged line's sample is kept (moved to the line's new
    number where lines above it went), the changed and the new lines are extracted, and no file or row of the old
    version is left: each sample's token ids are the new data's."""
    data, out = tmp_path / "d.jsonl", tmp_path / "out"
    old = write_dataset(data, 30, seed=21)
    assert run_extract(toy.url, data, out).returncode == 0
    lines = data.read_text().splitlines()
    lines[10] = json.dumps({"id": "s10", "input_ids": [1, 2, 3, 4, 5]})  # changed in place
    del lines[3]  # every line after it moves up one
    lines += [json.dumps({"id": f"new{i}", "input_ids": [7] * (20 + i)}) for i in range(2)]
    data.write_text("\n".join(lines) + "\n")
    refused = run_extract(toy.url, data, out)
    assert refused.returncode == 2 and "different dataset" in refused.stderr
    assert "28 kept" not in refused.stderr and "--force would continue" in refused.stderr
    assert "3 kept (lines unchanged), 25 moved" in refused.stderr, refused.stderr
    res = run_extract(toy.url, data, out, "--force")
    assert res.returncode == 0, res.stderr
    assert "3 kept (lines unchanged), 25 moved to their lines' new numbers, 2 dropped" in res.stderr, res.stderr
    assert "3 of 31 lines to do" in res.stderr
    assert "resuming: 28 of 31 samples already done" in res.stderr
    new = [json.loads(line)["input_ids"] for line in lines]
    assert_complete(out, new)
    assert new[9] == [1, 2, 3, 4, 5] and new[3] == old[4]


def test_force_into_another_dataset_redoes_every_line(toy, tmp_path):
    """A wholly different dataset with --force: nothing of the old one is counted, its extra files are gone."""
    data, out = tmp_path / "d.jsonl", tmp_path / "out"
    write_dataset(data, 12, seed=22)
    assert run_extract(toy.url, data, out).returncode == 0
    new = write_dataset(data, 8, seed=23)
    res = run_extract(toy.url, data, out, "--force")
    assert res.returncode == 0, res.stderr
    assert "0 kept (lines unchanged), 12 dropped" in res.stderr and "8 of 8 lines to do" in res.stderr
    assert "resuming" not in res.stderr
    assert_complete(out, new)

