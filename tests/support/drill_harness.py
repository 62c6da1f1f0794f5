"""Reliability drills, shared by the CI tests (a few trials) and `make drills` (many).

Each drill runs real processes in `init --demo` workspaces — the toy SGLang server, the
extraction client, `eagle3 serve` posting to a fake Slack Web API — injects a fault, and
checks what an operator cares about afterwards: every sample present once and valid,
training launched exactly once, no orphan process, every Slack message delivered in
order. It returns a `Tally`; problems are collected, not raised, so `make drills` can
report counts, and the tests assert that no problem was found.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
PY = sys.executable
CHANNEL = "C1"


@dataclass
class Tally:
    """What a drill did and found."""

    drill: str
    trials: int = 0
    faults: int = 0
    samples_verified: int = 0
    messages_delivered: int = 0
    sample_duplicates: int = 0
    message_duplicates: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    phases: dict[str, int] = field(default_factory=dict)  # where the faults landed

    def landed(self, phase: str) -> None:
        self.phases[phase] = self.phases.get(phase, 0) + 1

    def problem(self, trial: int, text: str) -> None:
        self.problems.append(f"trial {trial}: {text}")


class DrillWorkspace:
    """An `init --demo` workspace tuned for drills: a smaller dataset, a fast stand-in trainer
    unless the real torchrun one is asked for, Slack posts to a fake Web API."""

    def __init__(self, root: Path, *, samples: int, slack_url: str, real_trainer: bool = False,
                 server_flags: tuple[str, ...] = (), seed: int = 7) -> None:
        from pipeline.toy.demo_workspace import write_dataset, write_demo_workspace

        self.root, self.samples, self.real_trainer = root, samples, real_trainer
        self.cfg = write_demo_workspace(root, steps=40)  # the handoff is drilled, not the draft's quality
        write_dataset(root / "data.jsonl", samples, seed=seed)
        text = self.cfg.read_text().replace("tick_s = 1\n", "tick_s = 0.5\n")
        if not real_trainer:
            argv = [PY, str(FIXTURES / "fake_train.py"), str(root / "ckpt")]
            text = re.sub(r"(\[stages\.train\]\nargv = )\[.*?\]\n", lambda m: m.group(1) + json.dumps(argv) + "\n",
                          text, flags=re.S)
        if server_flags:
            text = re.sub(r'("toy-server", "--port", "\d+")', lambda m: m.group(1) + ", " +
                          ", ".join(json.dumps(f) for f in server_flags), text)
        text += f'\n[slack]\nchannel = "{CHANNEL}"\nallowed_user_ids = ["UOK"]\n'
        self.cfg.write_text(text)
        self.env = {**os.environ, "SLACK_BOT_TOKEN": "xoxb-drill", "SLACK_API_URL": slack_url + "/api/"}
        self.env.pop("EAGLE3_CONFIG", None)

    # --- driving ----------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "bot.cli", *args, "--config", str(self.cfg)], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def serve(self) -> subprocess.Popen:
        return subprocess.Popen([PY, "-m", "bot.cli", "serve", "--config", str(self.cfg)], cwd=ROOT, env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    @staticmethod
    def kill9(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    @staticmethod
    def terminate(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            DrillWorkspace.kill9(proc)

    def stop_all(self) -> None:
        self.cli("stop", "--all", "--grace", "2")

    # --- reading the store ----------------------------------------------------------------------
    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        path = self.root / ".eagle3" / "state.sqlite"
        if not path.exists():
            return []
        conn = sqlite3.connect(path, timeout=10)
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # not migrated yet
            return []
        finally:
            conn.close()

    def kv(self, key: str):
        rows = self.query("SELECT value FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    def latest(self, stage: str) -> dict | None:
        rows = self.query("SELECT state, exit_code FROM stage_procs WHERE stage = ? ORDER BY id DESC LIMIT 1", (stage,))
        return {"state": rows[0][0], "exit_code": rows[0][1]} if rows else None

    def procs(self, stage: str) -> int:
        return len(self.query("SELECT id FROM stage_procs WHERE stage = ?", (stage,)))

    def pending(self) -> int:
        return len(self.query("SELECT id FROM outbox WHERE status = 'pending' AND channel = ?", (CHANNEL,)))

    def finished_and_told(self) -> bool:
        """Extraction done, its 100 % milestone (a chart upload, drawn at delivery) sent, nothing pending.
        The milestone is queued a tick after the verdict: `done` with an empty outbox is not the end yet."""
        done = (self.kv("verdict:extract") or {}).get("verdict") == "done"
        told = self.query("SELECT id FROM outbox WHERE status = 'sent' AND text LIKE ?", ("%extract passed 100 %",))
        return done and bool(told) and self.pending() == 0

    def leftovers(self) -> list[str]:
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
            except psutil.Error:
                continue
            if str(self.root) in cmd:
                out.append(f"{p.info['pid']}: {cmd[:100]}")
        return out

    # --- checks -------------------------------------------------------------------------------
    def check_samples(self, tally: Tally, trial: int) -> None:
        """Every sample done exactly once, every file valid, no temp file, nothing counted without a file."""
        out = self.root / "out"
        try:
            conn = sqlite3.connect(out / "manifest.sqlite")
            done, failed, rows, distinct = conn.execute(
                "SELECT SUM(status = 'done'), SUM(status = 'failed'), COUNT(*), COUNT(DISTINCT idx) FROM samples"
            ).fetchone()
            conn.close()
        except sqlite3.Error as exc:
            return tally.problem(trial, f"manifest unreadable: {exc}")
        files = list((out / "hidden_states").iterdir())
        finals = [p for p in files if p.name.endswith(".safetensors")]
        temps = [p.name for p in files if not p.name.endswith(".safetensors")]
        dupes = (rows - distinct) + max(0, len(finals) - (done or 0))
        tally.sample_duplicates += dupes
        if done != self.samples or failed:
            tally.problem(trial, f"manifest: {done} done, {failed} failed of {self.samples}")
        if len(finals) != (done or 0) or temps:
            tally.problem(trial, f"{len(finals)} files for {done} done samples; temp files {temps[:3]}")
        verified = self.cli("verify", str(out), "--sample", str(self.samples))
        if verified.returncode != 0:
            tally.problem(trial, f"verify failed: {verified.stdout.strip()} {verified.stderr.strip()}")
        else:
            tally.samples_verified += len(finals)

    def check_delivery(self, tally: Tally, trial: int, fake) -> None:
        """Every outbox message accepted by Slack, in order for the channel; duplicates counted."""
        rows = self.query("SELECT id, text, status FROM outbox WHERE channel = ? ORDER BY id", (CHANNEL,))
        # a chart is posted as an upload whose comment is the message's text
        calls = [("chat.postMessage" if m == "files.completeUploadExternal" else m,
                  p.get("initial_comment", "") if m == "files.completeUploadExternal" else p.get("text", ""))
                 for m, p in fake.calls if m in ("chat.postMessage", "chat.update", "files.completeUploadExternal")]
        at = 0
        for msg_id, text, status in rows:
            if status != "sent":
                tally.problem(trial, f"message {msg_id} not delivered ({status}): {text[:60]}")
                continue
            found = next((i for i in range(at, len(calls)) if calls[i][1] == text), None)
            if found is None:
                tally.problem(trial, f"message {msg_id} missing from Slack or out of order: {text[:60]}")
                continue
            at = found
            tally.messages_delivered += 1
        posted = [t for m, t in calls if m == "chat.postMessage"]
        for text in set(posted):
            expected = sum(1 for _, t, _ in rows if t == text)
            tally.message_duplicates += max(0, posted.count(text) - max(expected, 1))

    def check_outcome(self, tally: Tally, trial: int, fake) -> None:
        """Samples and messages, after the run."""
        self.check_samples(tally, trial)
        self.check_delivery(tally, trial, fake)

    def check_clean(self, tally: Tally, trial: int, svc: subprocess.Popen | None = None) -> None:
        """After a trial, pass or fail: `eagle3 serve` (svc) ended, every stage stopped, no process of the
        workspace left (an orphan is a problem, then killed)."""
        if svc:
            self.terminate(svc)
        self.stop_all()
        left = self.leftovers()
        if left:
            tally.problem(trial, f"orphan processes: {left}")
            for line in left:
                try:
                    os.kill(int(line.split(":")[0]), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


def wait(predicate, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


# --- drill 1: kill -9 of `eagle3 serve` during extraction and the handoff -----------------------
def kill9_serve(base: Path, *, trials: int, real_trainer_trials: int = 1, seed: int = 1) -> Tally:
    """Kill `eagle3 serve` with SIGKILL at random moments (2–4 times a trial), restart it each
    time, and let the last instance finish the handoff and drain the outbox."""
    from tests.support.fake_slack import FakeSlack

    tally, rng, started = Tally("kill -9 of eagle3 serve during extraction and handoff"), random.Random(seed), time.time()
    for trial in range(trials):
        fake = FakeSlack()
        ws = DrillWorkspace(base / f"kill9-{trial}", samples=rng.randint(30, 60), slack_url=fake.url,
                            real_trainer=trial < real_trainer_trials, seed=trial)
        try:
            for args in (("start", "server"), ("start", "extract"), ("autostart", "on")):
                r = ws.cli(*args)
                if r.returncode:
                    tally.problem(trial, f"{args}: {r.stderr.strip()}")
            kills, budget = 0, rng.randint(2, 4)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                svc = ws.serve()
                if kills < budget:
                    extracting = (ws.latest("extract") or {}).get("state") == "running"
                    time.sleep(rng.uniform(0.5, 4.0) if extracting else rng.uniform(0.1, 2.0))
                    ws.kill9(svc)
                    step = (ws.kv("handoff") or {}).get("step")
                    tally.landed("extraction running" if step in (None, "armed", "waiting-for-completion")
                                 and (ws.latest("extract") or {}).get("state") == "running" else f"handoff: {step}")
                    kills += 1
                    continue
                finished = wait(lambda ws=ws: (ws.latest("train") or {}).get("state") == "exited"
                                and (ws.kv("verdict:train") or {}).get("verdict") == "done" and ws.pending() == 0,
                                timeout=max(1.0, deadline - time.monotonic()))
                time.sleep(1.0)  # a few more ticks: nothing may launch twice
                ws.terminate(svc)
                if not finished:
                    tally.problem(trial, f"did not finish: handoff {ws.kv('handoff')}, train {ws.latest('train')}, "
                                         f"{ws.pending()} messages pending")
                break
            tally.faults += kills
            train = ws.latest("train") or {}
            if ws.procs("train") != 1 or train.get("exit_code") != 0:
                tally.problem(trial, f"training launched {ws.procs('train')} times, last {train}")
            if not ws.real_trainer:
                launches = (ws.root / "ckpt" / "launches.txt")
                n = len(launches.read_text().splitlines()) if launches.exists() else 0
                if n != 1:
                    tally.problem(trial, f"the trainer ran {n} times")
            elif not (ws.root / "ckpt" / "progress.jsonl").exists():
                tally.problem(trial, "torchrun wrote no progress.jsonl")
            else:
                steps = [json.loads(x)["step"] for x in (ws.root / "ckpt" / "progress.jsonl").read_text().splitlines()]
                if steps != sorted(set(steps)):
                    tally.problem(trial, f"torchrun progress steps repeat: {steps[:10]}…")
            ws.check_outcome(tally, trial, fake)
        finally:
            ws.check_clean(tally, trial)
            fake.close()
        tally.trials += 1
    tally.seconds = time.time() - started
    return tally


# --- drill 2: the toy server crashing mid-extraction --------------------------------------------
def server_crash(base: Path, *, trials: int, seed: int = 2) -> Tally:
    """The server exits abruptly after N requests; the restart policy brings it back, the client
    waits and resumes, an alert is posted, and no invalid file is left."""
    from tests.support.fake_slack import FakeSlack

    tally, rng, started = Tally("SGLang (toy) server crash mid-extraction"), random.Random(seed), time.time()
    for trial in range(trials):
        fake = FakeSlack()
        ws = DrillWorkspace(base / f"crash-{trial}", samples=60, slack_url=fake.url, seed=trial,
                            server_flags=("--crash-after", str(rng.randint(25, 40))))
        svc = None
        try:
            svc = ws.serve()
            time.sleep(2.0)  # the notifier's cursor is set before anything happens
            ws.cli("start", "server")
            ws.cli("start", "extract")
            if not wait(lambda ws=ws: ws.finished_and_told()
                        or (ws.kv("verdict:extract") or {}).get("verdict") == "dead", timeout=180):
                tally.problem(trial, f"extraction did not finish: {ws.kv('verdict:extract')}")
            restarts = ws.procs("server") - 1
            tally.faults += restarts
            if restarts < 1:
                tally.problem(trial, "the server never crashed")
            if (ws.kv("verdict:extract") or {}).get("verdict") != "done":
                tally.problem(trial, f"extraction verdict {ws.kv('verdict:extract')}")
            texts = [p.get("text", "") for p in fake.of("chat.postMessage")]
            if not any("server is dead" in t for t in texts):
                tally.problem(trial, "no alert for the server crash")
            if not any("server restarted (attempt 1 of 3)" in t for t in texts):
                tally.problem(trial, "no message for the server's restart")
            ws.terminate(svc)
            ws.check_outcome(tally, trial, fake)
        finally:
            ws.check_clean(tally, trial, svc)
            fake.close()
        tally.trials += 1
    tally.seconds = time.time() - started
    return tally


# --- drill 3: disk full mid-run ----------------------------------------------------------------
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN): tried, not guessed."""
    import tempfile

    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as d:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True).returncode:
            return False
        subprocess.run(["umount", d], capture_output=True)
    return True


def disk_full(base: Path, *, trials: int) -> Tally:
    """Extraction's output on a 1 MB tmpfs: it stops with a clear error, an alert names the
    cause, nothing partial is counted; after the filesystem grows, a restart completes."""
    from tests.support.fake_slack import FakeSlack

    tally, started = Tally("disk full mid-extraction (1 MB tmpfs, then grown)"), time.time()
    for trial in range(trials):
        fake = FakeSlack()
        ws = DrillWorkspace(base / f"disk-{trial}", samples=40, slack_url=fake.url, seed=trial)
        out = ws.root / "out"
        out.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)],
                                 capture_output=True, text=True)
        if mounted.returncode:
            tally.problem(trial, f"cannot mount a tmpfs: {mounted.stderr.strip()}")
            break
        svc = None
        try:
            svc = ws.serve()
            time.sleep(2.0)
            ws.cli("start", "server")
            ws.cli("start", "extract")
            full = wait(lambda fake=fake: any("No space left on device" in p.get("text", "")
                                    for p in fake.of("chat.postMessage")), timeout=120)
            if not full:
                tally.problem(trial, f"no alert naming the full disk; extract {ws.kv('verdict:extract')}")
            wait(lambda ws=ws: (ws.latest("extract") or {}).get("state") != "running", timeout=60)
            tally.faults += 1
            # Grown before looking: sqlite cannot open a WAL database on a full filesystem (it needs
            # room for the -shm file), and growing changes no file.
            subprocess.run(["mount", "-o", "remount,size=64m", str(out)], check=True)
            conn = sqlite3.connect(out / "manifest.sqlite")
            done = {r[0] for r in conn.execute("SELECT idx FROM samples WHERE status = 'done'")}
            conn.close()
            names = [p.name for p in (out / "hidden_states").iterdir()]
            files = {int(n[3:].split(".")[0]) for n in names if n.endswith(".safetensors")}
            temps = [n for n in names if not n.endswith(".safetensors")]
            # A row without its file would be a loss; a file without its row, an uncounted sample.
            if len(done) >= ws.samples or done != files or temps:
                tally.problem(trial, f"while full: {len(done)} done, counted without a file {sorted(done - files)}, "
                                     f"file without a row {sorted(files - done)}, temp files {temps[:3]}")
            ws.cli("stop", "extract")
            r = ws.cli("start", "extract")  # the operator's restart after freeing space
            # The on-failure policy (1 s backoff in the demo config) may have restarted it first.
            if r.returncode and "extract is already running" not in r.stderr:
                tally.problem(trial, f"restart refused: {r.stderr.strip()}")
            if not wait(ws.finished_and_told, timeout=120):
                tally.problem(trial, f"did not resume to done: {ws.kv('verdict:extract')}")
            ws.terminate(svc)
            ws.check_outcome(tally, trial, fake)
        finally:
            ws.check_clean(tally, trial, svc)
            subprocess.run(["umount", "-l", str(out)], capture_output=True)
            fake.close()
        tally.trials += 1
    tally.seconds = time.time() - started
    return tally


# --- drill 4: Slack answering 500 for a minute ------------------------------------------------
def slack_outage(base: Path, *, trials: int, seed: int = 4) -> Tally:
    """Real HTTP to the fake Slack and a real store, on a simulated clock: 60 s of 500s while
    alerts, handoff steps and plain messages pile up on two channels; afterwards every message
    arrives once, in order per channel."""
    from bot.app import slack_client
    from bot.notifier import Notifier
    from pipeline.config import Workspace, parse_config
    from pipeline.store import Store
    from tests.support.fake_slack import FakeSlack

    tally, rng, started = Tally("Slack answering 500 for a minute"), random.Random(seed), time.time()
    for trial in range(trials):
        fake = FakeSlack()
        root = base / f"outage-{trial}"
        root.mkdir(parents=True)
        clock = {"t": 1_790_000_000.0}
        now = (lambda c: lambda: c["t"])(clock)  # noqa: E731 - one clock object per trial
        store = Store(root / "state.sqlite", clock=now)
        ws = {ch: Workspace(config=parse_config(f'[slack]\nchannel = "{ch}"\n', name="e.toml"), path=root / "e.toml")
              for ch in ("C1", "C2")}
        notifiers = [Notifier(ws=w, client=slack_client("xoxb-drill", fake.url + "/api/"), clock=now,
                              key_prefix=f"{ch}:") for ch, w in ws.items()]
        try:
            for n in notifiers:
                n.tick(store)
            fake.fail = {"chat.postMessage": 10**9, "chat.update": 10**9}
            expected: dict[str, list[str]] = {"C1": [], "C2": []}
            outage_end = clock["t"] + 60
            i = 0
            while clock["t"] < outage_end + 600 and (clock["t"] < outage_end or any(
                    store.pending_messages(channel=ch) for ch in expected)):
                if clock["t"] < outage_end and rng.random() < 0.5:
                    ch = rng.choice(["C1", "C2"])
                    text = f"trial {trial} message {i} to {ch}"
                    store.enqueue(channel=ch, kind="test", text=text)
                    expected[ch].append(text)
                    i += 1
                if clock["t"] >= outage_end:
                    fake.fail = {}
                for n in notifiers:
                    n.tick(store)
                clock["t"] += 1.0
            tally.faults += len(fake.faults)
            for ch, texts in expected.items():
                got = [p["text"] for p in fake.of("chat.postMessage") if p.get("channel") == ch]
                tally.message_duplicates += len(got) - len(set(got))
                if got != texts:
                    tally.problem(trial, f"{ch}: {len(got)} delivered of {len(texts)}, in order: {got == texts}")
                tally.messages_delivered += len(set(got) & set(texts))
            drained = clock["t"] - outage_end
            if drained > 400:
                tally.problem(trial, f"took {drained:.0f} s after Slack recovered")
        finally:
            store.close()
            fake.close()
        tally.trials += 1
    tally.seconds = time.time() - started
    return tally


# --- drill 5: a corrupt store file -------------------------------------------------------------
def corrupt_store(base: Path) -> Tally:
    """A damaged state file: `serve` and `status` stop with one clear line and leave it as it was."""
    import hashlib

    tally, started = Tally("corrupt store file"), time.time()
    variants = {
        "garbage": lambda raw: os.urandom(len(raw)),
        "header overwritten": lambda raw: b"\x00" * 100 + raw[100:],
        "truncated to half": lambda raw: raw[: len(raw) // 2],
        "pages scrambled": lambda raw: raw[:4096] + bytes(b ^ 0x5A for b in raw[4096:]),
    }
    for trial, (name, damage) in enumerate(variants.items()):
        root = base / f"corrupt-{trial}"
        root.mkdir(parents=True)
        cfg = root / "eagle3.toml"
        cfg.write_text(f'[stages.extract]\nargv = {json.dumps([PY, str(FIXTURES / "sleeper.py")])}\n')
        env = {k: v for k, v in os.environ.items() if k != "EAGLE3_CONFIG"}

        def run(*args, cfg=cfg, env=env):
            return subprocess.run([PY, "-m", "bot.cli", *args, "--config", str(cfg)], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=60)

        run("start", "extract")
        run("stop", "extract", "--grace", "1")
        state = root / ".eagle3" / "state.sqlite"
        for side in (".eagle3/state.sqlite-wal", ".eagle3/state.sqlite-shm"):
            (root / side).unlink(missing_ok=True)
        state.write_bytes(damage(state.read_bytes()))
        digest = hashlib.sha256(state.read_bytes()).hexdigest()
        tally.faults += 1
        for args in (("status",), ("serve", "--max-ticks", "1")):
            r = run(*args)
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            if r.returncode != 2 or len(lines) != 1 or "Traceback" in r.stderr or str(state) not in r.stderr:
                tally.problem(trial, f"{name}: `{' '.join(args)}` exit {r.returncode}: {r.stderr.strip()[:300]}")
        if hashlib.sha256(state.read_bytes()).hexdigest() != digest:
            tally.problem(trial, f"{name}: the damaged file was changed or recreated")
        tally.trials += 1
    tally.seconds = time.time() - started
    return tally
