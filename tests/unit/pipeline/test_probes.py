"""Probes: real readings, and every unknown path with its reason (never zeros)."""

import http.server
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from pipeline.manifest import SCHEMA
from pipeline.observe.probes.disk import projected_need, read_disk
from pipeline.observe.probes.files import FileScanner
from pipeline.observe.probes.gpu import FakeNvml, GpuProbe
from pipeline.observe.probes.process import read_process
from pipeline.observe.probes.progress import LogProgress, read_manifest, read_train_progress
from pipeline.observe.probes.server import ServerProbe, parse_metrics
from pipeline.states import StageProc


# --- files -----------------------------------------------------------------------
def make_tree(root, dirs=3, files=5):
    for d in range(dirs):
        sub = root / f"{d * 1000:06d}-{d * 1000 + 999:06d}"
        sub.mkdir(parents=True)
        for f in range(files):
            (sub / f"hs_{d * 1000 + f}.safetensors").write_bytes(b"x" * 100)


def test_scanner_counts_final_files_and_temp_bytes_as_activity(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "000000-000999" / ".hs_5.safetensors.tmp").write_bytes(b"y" * 50)
    (tmp_path / "000000-000999" / "hs_6.safetensors.tmp").write_bytes(b"y" * 30)
    r = FileScanner(str(tmp_path), suffix=".safetensors").scan()
    assert r.unknown is None
    assert r.value["count"] == 15 and r.value["final_bytes"] == 1500
    assert r.value["temp_bytes"] == 80 and r.value["bytes"] == 1580


def test_scanner_rescans_only_changed_directories(tmp_path):
    make_tree(tmp_path, dirs=5)
    old = time.time_ns() - 10_000_000_000
    for p in [tmp_path, *tmp_path.iterdir()]:
        os.utime(p, ns=(old, old))
    scanner = FileScanner(str(tmp_path))
    scanner.scan()
    assert scanner.rescanned == 6
    scanner.scan()
    assert scanner.rescanned == 0
    active = tmp_path / "002000-002999"
    (active / "hs_new.safetensors").write_bytes(b"z")
    r = scanner.scan()
    assert scanner.rescanned == 1 and r.value["count"] == 26


def test_scanner_same_tick_mtime_race(tmp_path):
    """A file added within the mtime granularity is not lost when the mtime does not move."""
    make_tree(tmp_path, dirs=1, files=1)
    d = tmp_path / "000000-000999"
    stamp = time.time_ns()
    os.utime(d, ns=(stamp, stamp))
    scanner = FileScanner(str(tmp_path))
    assert scanner.scan().value["count"] == 1
    (d / "hs_2.safetensors").write_bytes(b"x")
    os.utime(d, ns=(stamp, stamp))  # a coarse filesystem: same mtime after the change
    assert scanner.scan().value["count"] == 2


def test_scanner_budget_exhausted_is_unknown_not_partial(tmp_path):
    make_tree(tmp_path, dirs=3)
    ticks = iter(range(1000))
    scanner = FileScanner(str(tmp_path), budget_s=2, clock=lambda: next(ticks))
    r = scanner.scan()
    assert r.value is None and "exceeded its 2 s budget" in r.unknown


def test_scanner_missing_root_is_unknown(tmp_path):
    r = FileScanner(str(tmp_path / "nope")).scan()
    assert r.value is None and "no such directory" in r.unknown


def test_scanner_flat_directory(tmp_path):
    for i in range(300):
        (tmp_path / f"hs_{i}.safetensors").write_bytes(b"x")
    scanner = FileScanner(str(tmp_path))
    assert scanner.scan().value["count"] == 300
    (tmp_path / "hs_300.safetensors").write_bytes(b"x")
    assert scanner.scan().value["count"] == 301


# --- GPU ---------------------------------------------------------------------------
def test_no_nvml_is_unknown_with_reason_never_zero():
    def broken():
        raise OSError("NVML Shared Library Not Found")

    r = GpuProbe(backend_factory=broken).read()
    assert r.value is None
    assert r.unknown.startswith("NVML not available: driver not loaded")


def test_fake_nvml_readings_energy_delta_and_holders():
    script = lambda tick: [{"util": 40.0 + tick, "mem_used_mb": 1000.0, "power_w": 300.0, "power_limit_w": 700.0,  # noqa: E731
                            "energy_mj": 1_000_000.0 * tick, "pids": [4242]}]
    probe = GpuProbe(backend_factory=lambda: FakeNvml(script))
    first = probe.read({4242: "server"}).value[0]
    second = probe.read({4242: "server"}).value[0]
    assert first["energy_j_delta"] is None and second["energy_j_delta"] == 1000.0
    assert second["util"] == 41.0 and second["holders"] == ["server"]


def test_gpu_read_failure_is_unknown():
    class Flaky(FakeNvml):
        def read(self, index, since_us):
            raise RuntimeError("GPU is lost")

    r = GpuProbe(backend_factory=lambda: Flaky(lambda t: [{}])).read()
    assert r.value is None and "GPU is lost" in r.unknown


def test_real_nvml_absent_here_is_unknown():
    r = GpuProbe().read()  # this machine has no GPU driver
    assert (r.value is None and r.unknown.startswith("NVML not available")) or isinstance(r.value, list)


# --- server ----------------------------------------------------------------------------
METRICS = """# HELP sglang:num_running_reqs x
sglang:num_running_reqs{model_name="m"} 1.0
sglang:num_queue_reqs{model_name="m"} 0.0
sglang:num_requests_total{model_name="m"} 22391.0
sglang:gen_throughput{model_name="m"} NaN
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    health = 200
    metrics = METRICS
    seen: list = []

    def do_GET(self):  # noqa: N802
        self.seen.append(self.path)
        body, code = {"/health": (b"", _Handler.health), "/metrics": (_Handler.metrics.encode(), 200),
                      # an older server: no /server_info, the deprecated name answers
                      "/get_server_info": (b'{"version": "0.5.23"}', 200)}.get(self.path, (b"", 404))
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    _Handler.health, _Handler.metrics, _Handler.seen = 200, METRICS, []


def test_server_probe_reads_health_and_activity(http_server):
    r = ServerProbe(http_server).read()
    assert r.value == {"healthy": True, "health_status": 200, "running_reqs": 1.0, "queue_reqs": 0.0,
                       "requests_total": 22391.0, "version": "0.5.23"}


def test_server_probe_asks_server_info_first_and_polls_health_not_a_generation(http_server):
    ServerProbe(http_server).read()
    assert "/health_generate" not in _Handler.seen and "/health" in _Handler.seen
    assert _Handler.seen.index("/server_info") < _Handler.seen.index("/get_server_info")


def test_metrics_with_either_prefix_and_an_unreadable_format(http_server):
    _Handler.metrics = METRICS.replace("sglang:", "sglang_")
    v = ServerProbe(http_server).read().value
    assert v["running_reqs"] == 1.0 and v["requests_total"] == 22391.0
    _Handler.metrics = "sglang:num_running_reqs{model_name=m 1.0\n"
    v = ServerProbe(http_server).read().value
    assert "running_reqs" not in v and v["metrics_unknown"].startswith("/metrics is not in Prometheus' text format")


def test_server_503_is_unhealthy(http_server):
    _Handler.health = 503
    assert ServerProbe(http_server).read().value["healthy"] is False


def test_server_unreachable_is_unknown():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = ServerProbe(f"http://127.0.0.1:{port}", timeout_s=1).read()
    assert r.value is None and "unreachable" in r.unknown


def test_parse_metrics_sums_labels_and_skips_nan():
    m = parse_metrics(METRICS + 'sglang:num_running_reqs{model_name="n"} 2\n')
    assert m["sglang:num_running_reqs"] == 3.0 and "sglang:gen_throughput" not in m


# --- disk, progress, process ------------------------------------------------------------------
def test_projected_need_formula():
    # The incident's dataset: 87.8 M tokens × 4 layers × 7,168 × 2 bytes ≈ 5 TB.
    assert projected_need(tokens_left=87_800_000, layers=4, hidden=7168) == 87_800_000 * 4 * 7168 * 2
    assert projected_need(tokens_left=None, layers=4, hidden=7168) is None


def test_disk_reading_and_fit(tmp_path):
    r = read_disk(str(tmp_path / "not-yet"), need_bytes=10**30)
    assert r.value["free_bytes"] > 0 and r.value["fits"] is False
    assert read_disk(None, need_bytes=None).unknown == "no output directory configured"


def write_manifest(out, *, done, failed, total, tokens=10):
    out.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(out / "manifest.sqlite")
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO samples (idx, status, tokens) VALUES (?, ?, ?)",
                     [(i, "done" if i < done else "failed", tokens) for i in range(done + failed)])
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("samples_total", str(total)), ("tokens_total", str(total * tokens)),
                                                       ("layers", "4"), ("hidden_size", "64")])
    conn.commit()
    conn.close()


def test_manifest_progress(tmp_path):
    write_manifest(tmp_path, done=7, failed=1, total=20)
    r = read_manifest(tmp_path)
    assert r.value["done"] == 7 and r.value["failed"] == 1 and r.value["total"] == 20
    assert r.value["tokens_done"] == 80 and r.value["tokens_total"] == 200 and r.value["layers"] == 4


def test_manifest_missing_or_corrupt_is_unknown(tmp_path):
    assert "no manifest yet" in read_manifest(tmp_path).unknown
    (tmp_path / "manifest.sqlite").write_bytes(b"junk" * 1000)
    assert "unreadable" in read_manifest(tmp_path).unknown
    assert not (tmp_path / "manifest.sqlite-wal").exists()


def test_train_progress_reads_last_complete_line(tmp_path):
    (tmp_path / "progress.jsonl").write_text(
        '{"step": 1, "total_steps": 80, "loss": 3.0, "kl": 2.0, "tokens_per_s": 100}\n'
        '{"step": 2, "total_steps": 80, "loss": 2.9, "kl": 1.9, "tokens_per_s": 100}\n{"step": 3, "tot')
    r = read_train_progress(tmp_path)
    assert r.value["done"] == 2 and r.value["total"] == 80 and r.value["unit"] == "steps"


def test_log_regex_progress_follows_rotation(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("noise\nsample 5/100\nsample 6/1")
    tail = LogProgress(log, r"sample (?P<done>\d+)/(?P<total>\d+)")
    assert tail.read().value == {"done": 5, "failed": 0, "total": 100, "unit": "lines"}
    with open(log, "a") as fh:
        fh.write("00\n")
    assert tail.read().value["done"] == 6
    log.rename(tmp_path / "x.log.1")
    log.write_text("sample 7/100\n")
    assert tail.read().value["done"] == 7


def test_process_probe_over_real_group():
    child = subprocess.Popen([sys.executable, "-c", "import os,time\nif os.fork()==0: time.sleep(30)\nelse:\n"
                              " x=sum(range(3_000_000)); open(os.devnull,'w').write('x'*100000); time.sleep(30)"],
                             start_new_session=True)
    import psutil
    try:
        time.sleep(1.0)
        row = {"id": 1, "stage": "extract", "state": "running", "pid": child.pid, "pgid": child.pid,
               "create_time": psutil.Process(child.pid).create_time(), "exit_code": None, "stop_requested": 0}
        r = read_process(StageProc.from_row(row))
        assert r.value["alive"] is True and r.value["members"] == 2 and r.value["cpu_s"] > 0
        assert r.value["disk_wait"] == 0  # running and sleeping, neither in uninterruptible disk sleep
        # a member in uninterruptible disk sleep (an fsync to a slow filesystem) is counted, which the
        # diagnosis reads as work for a while (Policy.disk_wait_s)
        real = psutil.Process.status
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(psutil.Process, "status", lambda p: psutil.STATUS_DISK_SLEEP if p.pid != child.pid else real(p))
            assert read_process(StageProc.from_row(row)).value["disk_wait"] == 1
    finally:
        os.killpg(child.pid, 9)
        child.wait()
    ended = read_process(StageProc.from_row({**row, "state": "exited", "exit_code": None, "signal": 9}))
    assert ended.value == {"alive": False, "exit_code": -9, "stop_requested": False}
    assert read_process(None).unknown == "stage not started"


VFORK_PARENT = """#include <unistd.h>
#include <sys/wait.h>
int main(void) { pid_t p = vfork(); if (p == 0) { sleep(20); _exit(0); } int s; waitpid(p, &s, 0); return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stand-in")
def test_process_probe_reads_a_real_uninterruptible_sleep(tmp_path):
    """A real process in the kernel's uninterruptible sleep (`D` in ps) — the state of an fsync to a slow
    filesystem — counted in `disk_wait`. The stand-in is a vfork parent, which the kernel holds in that state
    until its child execs or exits: the one way to put a process there on demand without a slow disk."""
    import psutil

    (tmp_path / "vf.c").write_text(VFORK_PARENT)
    subprocess.run(["cc", "-o", str(tmp_path / "vf"), str(tmp_path / "vf.c")], check=True, timeout=60)
    child = subprocess.Popen([str(tmp_path / "vf")], start_new_session=True)
    try:
        row = {"id": 1, "stage": "train", "state": "running", "pid": child.pid, "pgid": child.pid,
               "create_time": psutil.Process(child.pid).create_time(), "exit_code": None, "stop_requested": 0}
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_DISK_SLEEP and time.monotonic() < deadline:
            time.sleep(0.05)
        if psutil.Process(child.pid).status() != psutil.STATUS_DISK_SLEEP:
            pytest.skip("this kernel does not show a vfork parent in uninterruptible sleep")
        r = read_process(StageProc.from_row(row))
        assert r.value["members"] == 2 and r.value["disk_wait"] == 1, r.value
    finally:
        os.killpg(child.pid, 9)
        child.wait(timeout=10)


def test_a_failed_stage_reports_the_last_line_of_its_log(tmp_path):
    log = tmp_path / "extract.log"
    log.write_text("sample 9/10\nextract: No space left on device; free space, then run the same command to resume\n\n")
    row = {"id": 1, "stage": "extract", "state": "exited", "exit_code": 2, "signal": None, "stop_requested": 0,
           "log": str(log)}
    assert read_process(StageProc.from_row(row)).value["last_line"].startswith("extract: No space left on device")
    assert "last_line" not in read_process(StageProc.from_row({**row, "exit_code": 0})).value
    assert "last_line" not in read_process(StageProc.from_row({**row, "stop_requested": 1})).value


def test_train_progress_carries_the_last_validation(tmp_path):
    from pipeline.observe.probes.progress import read_train_progress

    (tmp_path / "progress.jsonl").write_text('{"step": 5, "total_steps": 9, "loss": 2.0, "kl": 0.5, "tokens_per_s": 1}\n')
    assert "acc_by_depth" not in read_train_progress(tmp_path).value
    (tmp_path / "validation.jsonl").write_text('{"step": 4, "acc": [0.9, 0.8], "baseline_top1": 0.01}\n{"step": 5, "ac')
    v = read_train_progress(tmp_path).value
    assert v["acc_by_depth"] == [0.9, 0.8] and v["validated_at_step"] == 4 and v["done"] == 5


TORCHRUN_FAILED = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/opt/eagle3-ops/pipeline/train/loop.py", line 455, in _loop
[rank1]:     loss_sum, ent_sum, n, skipped = train_step(ddp, model, opt, sched, feed)
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
E1205 10:00:01.000000 4242 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
  File "/opt/eagle3-ops/.venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pipeline.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_10:00:01
  host      : gpu-host
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4243)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


@pytest.mark.parametrize(("log", "says"), [
    (TORCHRUN_FAILED, "torchrun root cause: rank 1 (local_rank: 1) failed, exitcode 1 (pid: 4243); "
                      "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (loop.py:455 in _loop)"),
    (TORCHRUN_FAILED.replace("exitcode  : 1 (pid: 4243)", "exitcode  : -9 (pid: 4243) (SIGKILL)").replace(
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "Signal 9 (SIGKILL) received by PID 4243"),
     "torchrun root cause: rank 1 (local_rank: 1) failed, exitcode -9 (pid: 4243) (SIGKILL): "
     "Signal 9 (SIGKILL) received by PID 4243"),
    ('Traceback (most recent call last):\n  File "/x/prepare.py", line 12, in main\n    run()\n'
     'ValueError: turn 2: content is not text\n==========\n', "ValueError: turn 2: content is not text "
                                                            "(prepare.py:12 in main)"),
    ("step 3\nsomething went wrong\n====================\n\n", "something went wrong"),
    ("[rank1]: train: rank 1 needs cuda:1 but 1 GPU(s) are visible\n"
     + TORCHRUN_FAILED[TORCHRUN_FAILED.index("E1205"):].replace("exitcode  : 1", "exitcode  : 2"),
     "torchrun root cause: rank 1 (local_rank: 1) failed, exitcode 2 (pid: 4243); rank 1 said: train: rank 1 needs "
     "cuda:1 but 1 GPU(s) are visible"),
])
def test_a_crash_is_summarised_by_its_cause_not_by_the_logs_last_rule(tmp_path, log, says):
    """The crash alert quotes torchrun's root cause (rank, exit code or signal, and the rank's own error where the
    log holds it), or the last traceback's exception and frame, never a closing line of '='."""
    from pipeline.observe.probes.process import last_log_line

    path = tmp_path / "train.log"
    path.write_text(log)
    assert last_log_line(str(path)) == says


def test_training_progress_carries_the_simulated_tau_its_previous_value_and_when_it_stopped_rising(tmp_path):
    """Issue 51: τ = 1 + Σₖ Πⱼ≤ₖ top-1ⱼ at each validation, the one before, and the step of the best once the last two
    validations did not raise it by 0.02 — what status, the chart, Prometheus and the ending show."""
    import json

    from handlers.render.views import tau_text
    from pipeline.observe.probes.progress import read_train_progress

    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 4000, "total_steps": 8000, "loss": 1.0}) + "\n")
    vals = [(1000, [0.5, 0.4]), (2000, [0.8, 0.5]), (3000, [0.8, 0.51]), (4000, [0.79, 0.5])]
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps({"step": s, "acc": a}) + "\n" for s, a in vals))
    v = read_train_progress(tmp_path).value
    assert v["tau"] == pytest.approx(1 + 0.79 + 0.79 * 0.5, abs=1e-3) and v["tau_step"] == 4000
    assert v["tau_prev"] == pytest.approx(1 + 0.8 + 0.8 * 0.51, abs=1e-3) and v["tau_prev_step"] == 3000
    assert v["tau_flat_since"] == 2000  # 2.40 at 2,000; 2.208 and 2.185 after it
    assert tau_text(v) == "τ ≈ 2.19 at step 4,000 (2.21 at 3,000); not rising since step 2,000"
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps({"step": s, "acc": a}) + "\n" for s, a in vals[:2]))
    v = read_train_progress(tmp_path).value
    assert "tau_flat_since" not in v and tau_text(v) == "τ ≈ 2.20 at step 2,000 (1.70 at 1,000)"
    assert tau_text({"loss": 1.0}) is None
