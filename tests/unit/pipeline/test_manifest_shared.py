"""The manifest on a filesystem shared across hosts (NFS, Lustre): a rollback journal, never WAL, read
correctly by another process while the writer writes (issue 18: the job and the controller on two hosts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline.manifest import (
    FORCE_NETWORK_ENV,
    MANIFEST_NAME,
    filesystem_type,
    shared_across_hosts,
    summarize,
)
from tests.conftest import ROOT

WRITER = textwrap.dedent("""
    import sys, time
    from pipeline.manifest import Manifest
    m = Manifest(sys.argv[1])
    m.set_meta({"samples_total": 200, "tokens_total": 200 * 64})
    print("ready", flush=True)
    for i in range(200):
        m.record(idx=i, sample_id=None, status="done", tokens=64, nbytes=1, attempts=1, error=None, now=time.time(),
                 latency_s=0.01)
        time.sleep(0.005)
    print("journal", m.conn.execute("PRAGMA journal_mode").fetchone()[0], flush=True)
    m.close()
""")


def header_modes(path) -> tuple[int, int]:
    """Bytes 18 and 19 of an SQLite file: 1, 1 for a rollback journal, 2, 2 for WAL."""
    head = path.read_bytes()[:20]
    return head[18], head[19]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [True, False])
def test_a_reader_in_another_process_sees_every_commit_in_order(tmp_path, shared):
    env = {**os.environ, FORCE_NETWORK_ENV: "1" if shared else "0"}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              text=True)
    seen = []
    assert writer.stdout.readline().strip() == "ready"  # the schema exists: from here every read must succeed
    while writer.poll() is None:
        try:
            seen.append(summarize(tmp_path)["done"])
        except Exception as exc:  # noqa: BLE001 - a torn read would show here
            pytest.fail(f"the reader failed while the writer wrote: {exc!r}")
    out = writer.communicate(timeout=30)[0]
    assert writer.returncode == 0
    assert seen == sorted(seen) and summarize(tmp_path)["done"] == 200
    assert f"journal {'delete' if shared else 'wal'}" in out
    assert header_modes(tmp_path / MANIFEST_NAME) == ((1, 1) if shared else (2, 2))
    if shared:
        assert not (tmp_path / (MANIFEST_NAME + "-wal")).exists()


def test_network_filesystems_are_detected_from_the_mount_table(monkeypatch, tmp_path):
    monkeypatch.delenv(FORCE_NETWORK_ENV, raising=False)
    assert filesystem_type(tmp_path) in ("ext4", "tmpfs", "xfs", "btrfs", "overlay", "zfs")
    assert not shared_across_hosts(tmp_path)
    import pipeline.manifest as manifest

    real = manifest.Path.read_text
    table = f"nfs-server:/export {tmp_path} nfs4 rw 0 0\n/dev/root / ext4 rw 0 0\n"
    monkeypatch.setattr(manifest.Path, "read_text",
                        lambda self, *a, **k: table if str(self) == "/proc/mounts" else real(self, *a, **k))
    assert filesystem_type(tmp_path / "out") == "nfs4" and shared_across_hosts(tmp_path / "out")
    assert filesystem_type(tmp_path.parent) == "ext4"
