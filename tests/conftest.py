"""Shared fixtures: loopback-only network, workspaces, the eagle3 CLI as a subprocess."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import Workspace, parse_config

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PY = sys.executable


def _loopback(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    """Any test that opens a non-loopback connection fails."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guard(address):
        if not _loopback(address):
            raise AssertionError(f"test tried to open a non-loopback connection to {address!r}")

    def connect(self, address):
        guard(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        guard(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


def fixture_argv(name: str, *args: str) -> list[str]:
    """argv running one of tests/fixtures/*.py with this interpreter."""
    return [PY, str(FIXTURES / name), *args]


def toml_list(items: list[str]) -> str:
    """A TOML array of strings."""
    return json.dumps(items)


@pytest.fixture
def make_workspace(tmp_path):
    """Write an eagle3.toml whose stages run fixture programs; returns its path."""

    def make(stages: dict[str, list[str]] | None = None, extra: str = "") -> Path:
        stages = stages or {}
        parts = [extra]
        for name, argv in stages.items():
            parts.append(f"[stages.{name}]\nargv = {toml_list(argv)}\n")
        cfg = tmp_path / "eagle3.toml"
        cfg.write_text("\n".join(parts))
        return cfg

    return make


def workspace_of(tmp_path: Path, text: str) -> Workspace:
    """A workspace from config text, rooted in tmp_path (nothing written until its store is opened)."""
    return Workspace(config=parse_config(text, name="t.toml"), path=tmp_path / "t.toml")


@pytest.fixture
def ctl(request, tmp_path):
    """A controller over the requesting test module's CONFIG (config text), closed after the test."""
    from pipeline.controller import Controller

    c = Controller(workspace=workspace_of(tmp_path, request.module.CONFIG))
    yield c
    c.close()


# Commands a test runs in this process through `main(argv)` (sqlite-utils' CliRunner style): an interpreter start
# costs ~0.5 CPU-s on these 2 cores. Those that run a stage's own work, a server, or install signal handlers
# (extract, regenerate, serve, toy-server, demo) keep a real process, as do `eagle3(..., process=True)` calls.
IN_PROCESS = frozenset({"start", "stop", "status", "autostart", "export-trace", "logs", "init", "verify", "remind",
                        "diagnose", "check-config", "--help"})


def eagle3(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 60,
           process: bool = False) -> subprocess.CompletedProcess:
    """Run the eagle3 CLI as a user would: its exit code, stdout and stderr."""
    if not process and args and args[0] in IN_PROCESS:
        return run_main(list(args), cwd=cwd, env=env)
    full_env = {k: v for k, v in os.environ.items() if k != "EAGLE3_CONFIG"}
    full_env.update(env or {})
    return subprocess.run([PY, "-m", "bot.cli", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(argv: list[str], *, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`bot.cli.main(argv)` in this process, in `cwd` with `env` added (EAGLE3_CONFIG removed), its output
    captured; the directory and the environment are restored after."""
    import contextlib
    import io

    from bot.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_cwd, saved_env = os.getcwd(), dict(os.environ)
    try:
        os.chdir(cwd or ROOT)
        os.environ.pop("EAGLE3_CONFIG", None)
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: --help (0), a usage error (2)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["eagle3", *argv], code, out.getvalue(), err.getvalue())


def status_json(cfg: Path, *, cli: bool = False) -> dict:
    """`eagle3 status --json`'s object: through the CLI (`cli=True`), or from the same controller verb in
    this process, which polls without an interpreter start each time (~0.4 CPU-s a call on 2 cores)."""
    if cli:
        out = eagle3("status", "--json", "--config", str(cfg))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    from pipeline.controller import Controller

    with Controller.open(str(cfg)) as ctl:
        return json.loads(json.dumps(ctl.status().to_json()))


def wait_for(predicate, *, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll until `predicate()` is truthy; fail the test with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder every xdist worker of this run shares (the run's base temp when not under xdist)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / name


def build_once(path: Path, build) -> Path:
    """Run `build(path)` once per test run, whichever worker gets there first; the others wait
    for it. `path` is only read afterwards."""
    from filelock import FileLock

    with FileLock(str(path) + ".lock", timeout=600):
        if not (path / ".built").exists():
            if path.exists():
                import shutil
                shutil.rmtree(path)  # a build that failed half-way
            path.mkdir(parents=True)
            build(path)
            (path / ".built").touch()
    return path


def _build_toy_extraction(root: Path) -> None:
    from tests.toy import ToyServer, write_dataset

    write_dataset(root / "d.jsonl", 160, lo=32, hi=256, seed=42)
    server = ToyServer()
    try:
        res = eagle3("extract", "--server", server.url, "--data", str(root / "d.jsonl"), "--out", str(root / "out"),
                     "--concurrency", "8", timeout=300)
        assert res.returncode == 0, res.stderr
    finally:
        server.stop()
    assert eagle3("toy-server", "--export-target", str(root / "target")).returncode == 0


@pytest.fixture(scope="session")
def toy_extraction(tmp_path_factory):
    """160 samples extracted from the toy server (3 aux + final) and its LM head; built once per run,
    shared by every worker, read only (tests that change it copy it first)."""
    root = build_once(shared_dir(tmp_path_factory, "toy-extraction"), _build_toy_extraction)
    samples = [json.loads(line)["input_ids"] for line in (root / "d.jsonl").read_text().splitlines()]
    return {"out": root / "out", "target": root / "target", "samples": samples, "data": root / "d.jsonl"}


# The toy trainer's settings the tests share: small batches and a short unroll, a seventh of the CPU of the
# defaults (22 CPU-s for 80 steps, measured), and the draft still learns (kl 7.4 → 0.7, top-1 0.54 against 0.014).
TRAIN_SMALL = ["--token-budget", "1024", "--ttt", "3", "--lr", "1e-2"]
TRAIN_STEPS = 30
TRAIN_ENV = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                 CUDA_VISIBLE_DEVICES="")  # 2 CPU processes whatever GPUs the host has (a 1-GPU host has no cuda:1)


def _build_uninterrupted(root: Path, extraction: dict) -> None:
    """30 steps of the toy trainer under torchrun, 2 CPU ranks, never interrupted: what a resumed run must end as."""
    old_umask = os.umask(0o022)  # inherited by the trainers: their files must be readable by others (issue 30)
    try:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "pipeline.train", "--data", str(extraction["out"]), "--target-model",
                              str(extraction["target"]), "--steps", str(TRAIN_STEPS), *TRAIN_SMALL, "--out",
                              str(root / "ckpt")], cwd=ROOT, env=TRAIN_ENV, capture_output=True, text=True, timeout=280)
    finally:
        os.umask(old_umask)
    (root / "output.txt").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]


@pytest.fixture(scope="session")
def uninterrupted_training(tmp_path_factory, toy_extraction):
    """The toy trainer's 30 steps on the shared extraction, uninterrupted (built once per run, read only): the
    run a resume after SIGTERM (test_train) or after Slurm's time limit (test_slurm) must match."""
    root = build_once(shared_dir(tmp_path_factory, "uninterrupted-training"),
                      lambda path: _build_uninterrupted(path, toy_extraction))
    return {"ckpt": root / "ckpt", "output": (root / "output.txt").read_text()}


# The longest tests start first, one per worker, so that none of them begins last and holds the run's
# end (measured on 2 cores). xdist's `load` scheduler hands each worker two tests to begin with, then
# one more whenever it is down to one: a short test goes second in each of the first pairs, so that
# two long ones never share a worker's opening.
LONGEST_FIRST = (
    "test_demo.py::test_demo_tells_the_whole_story",
    "test_production_path.py::test_the_guides_production_path",
    "test_whole_run.py::test_a_whole_demo_run_told_in_a_channel",
    # mostly waiting on Slurm (its time limit, a requeue's hold, a node's timeout): begun early, it overlaps the rest
    "test_slurm.py::test_a_two_node_training_hits_its_time_limit",
    "test_handoff.py::test_service_death_at_each_step",
    "test_train.py::test_torchrun_learns_the_target",
    "test_operating.py::test_stop_start_crash_and_relaunch",
    "test_drills.py::test_kill_9_of_serve",
    "test_drills.py::test_disk_full_mid_run",
    "test_drills.py::test_server_crash_mid_extraction",
    "test_extract.py::test_concurrency_is_held",
    "test_handoff.py::test_double_arm",
    "test_regenerate.py::test_from_a_chat_file_to_a_measured_draft",
    "test_week.py::test_five_runs_in_one_workspace",
)


SLURM_TESTS = ROOT / "tests" / "integration" / "test_slurm.py"
SLURM_BOOTSTRAP = "EAGLE3_SLURM_BOOTSTRAP"


def pytest_configure(config):
    """As root, with the Slurm tests selected, start the test cluster (tests/slurm/cluster.sh up: apt-get
    install when missing, then the daemons) in the background as the run begins, so no worker waits on
    the install; the `cluster` fixture waits for its end. Workers inherit the status file's name."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.geteuid() != 0 or SLURM_BOOTSTRAP in os.environ:
        return
    args = [Path(a.split("::")[0]).resolve() for a in config.args] or [ROOT]
    if not any(a == SLURM_TESTS or a in SLURM_TESTS.parents for a in args):
        return
    status = Path(f"/tmp/eagle3-slurm-bootstrap-{os.getpid()}")
    status.unlink(missing_ok=True)
    subprocess.Popen(["bash", "-c", '"$0" up > "$1.log" 2>&1; echo $? > "$1.tmp"; mv "$1.tmp" "$1"',
                      str(ROOT / "tests" / "slurm" / "cluster.sh"), str(status)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    os.environ[SLURM_BOOTSTRAP] = str(status)
    config._eagle3_slurm_status = status  # this process started the bootstrap: it brings down what it started


def pytest_unconfigure(config):
    """Bring down the test cluster this run started (slurmctld, slurmd and cluster.sh's own munged), and
    only that: a cluster that was already up when the run began (`already up` in the bootstrap's log)
    stays, as does any munged or Slurm of the host's."""
    status = getattr(config, "_eagle3_slurm_status", None)
    if status is None:
        return
    for _ in range(600):  # the bootstrap may still be installing: wait for its end (at most a minute)
        if status.exists():
            break
        time.sleep(0.1)
    log = Path(f"{status}.log")
    if "already up" not in (log.read_text() if log.exists() else ""):
        subprocess.run(["bash", str(ROOT / "tests" / "slurm" / "cluster.sh"), "down"], capture_output=True, timeout=60)
    for path in (status, log):
        path.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, key in enumerate(LONGEST_FIRST) if key in item.nodeid), len(LONGEST_FIRST))

    whole = (all(Path(a.split("::")[0]).resolve() in (ROOT, ROOT / "tests") for a in config.args)
             and not config.getoption("keyword") and not config.getoption("markexpr"))
    missing = [key for key in LONGEST_FIRST if not any(key in it.nodeid for it in items)] if whole else []
    if missing:  # a renamed test would silently lose its place at the front (issue 36)
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names {', '.join(missing)}, which no test "
                                "matches any more: rename or remove the entry")

    ranked = sorted(items, key=rank)  # stable: everything else in collection order
    longest = [it for it in ranked if rank(it) < len(LONGEST_FIRST)]
    rest = ranked[len(longest):]
    workers = config.getoption("numprocesses", default=None) or 0
    workers = workers if isinstance(workers, int) else 0
    order = []
    for i, item in enumerate(longest):
        order.append(item)
        if i < workers and rest:
            order.append(rest.pop(0))
    items[:] = order + rest
