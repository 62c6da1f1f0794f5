"""`eagle3 demo`: the whole story in a temporary `init --demo` workspace, on the console transport.

Toy server and extraction start, auto-start is armed as an operator would, the
monitor reports progress, the handoff stops the server and launches 2-process CPU
training, and a summary closes. Nothing is left running, Ctrl-C included.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bot.service import console_notifier
from handlers.render.views import train_guard_text
from pipeline.config import STAGE_NAMES, load_workspace
from pipeline.controller import Controller, TrainGuardError
from pipeline.errors import UserError
from pipeline.manifest import summarize
from pipeline.monitor import Monitor
from pipeline.observe.charts import render_run
from pipeline.states import GPU_WAIT, LAUNCHING
from pipeline.toy.demo_workspace import write_demo_workspace
from pipeline.train.export import launch_line

TIMEOUT_S = 330.0
POST_EVERY_S = 8.0
EVAL_DEPTH, EVAL_PROMPTS, EVAL_NEW_TOKENS = 5, 48, 64


def _say(text: str) -> None:
    print(text, flush=True)


def _demo_notifier(ws, slack_channel: str | None):
    """The console transport, or a real Slack channel when SLACK_BOT_TOKEN is set and a channel is given."""
    token = os.environ.get("SLACK_BOT_TOKEN")
    if not slack_channel:
        return console_notifier(ws), "console transport: messages printed as they would appear in Slack"
    assert token, "run_demo refuses a channel without SLACK_BOT_TOKEN"
    from bot.app import slack_client
    from bot.notifier import Notifier

    client = slack_client(token, os.environ.get("SLACK_API_URL"))
    return Notifier(ws=ws, client=client, channel=slack_channel), f"posting to Slack channel {slack_channel}"


def run_demo(slack_channel: str | None = None, *, regenerate: bool = False) -> int:
    """Run the story; returns the exit status."""
    if slack_channel and not os.environ.get("SLACK_BOT_TOKEN"):
        raise UserError("demo --slack-channel: set SLACK_BOT_TOKEN (and invite the bot to the channel)")
    root = Path(tempfile.mkdtemp(prefix="eagle3-demo-"))
    log = root / "demo.log"
    logging.basicConfig(filename=log, level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    for name in ("httpx", "httpcore", "urllib3", "apscheduler"):  # not a line per probe request (as under serve)
        logging.getLogger(name).setLevel(logging.WARNING)
    _say(f"eagle3 demo — workspace {root} (stage logs and details: {log})")
    if regenerate:
        _say("0. preparing 300 ShareGPT conversations (chat.jsonl) with the toy target's tokenizer and chat template: "
             "eagle3 prepare, loss mask on the assistant's tokens")
    cfg = write_demo_workspace(root, regenerate=regenerate, say=lambda m: _say("   " + m))
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    notifier, transport = _demo_notifier(ws, slack_channel)
    _say(f"   {transport}")
    monitor = Monitor(ws=ws, on_tick=lambda store, _results: notifier.tick(store))
    thread = threading.Thread(target=monitor.run, name="monitor", daemon=True)
    started = time.time()
    # Ctrl-C sets a flag the waits check, rather than raising KeyboardInterrupt wherever the main thread
    # happens to be (inside a store transaction, a stage start): the teardown then runs from a clean place.
    interrupted = threading.Event()
    # SIGTERM (`kill`, `pkill`) the same: left to its default it ended the demo without the teardown, leaving
    # the toy server, in its own session, running
    previous = {sig: signal.signal(sig, lambda *_: interrupted.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if regenerate:
            _say("1. starting the toy SGLang server and the regeneration of 300 conversations' assistant turns by the "
                 "target; auto-start starts extraction of the regenerated data when it is verified complete")
            ctl.start("server")
            ctl.start("regenerate")
        else:
            _say("1. starting the toy SGLang server and extraction of 300 samples")
            ctl.start("server")
            ctl.start("extract")
        # the run's status message first: milestones and handoff steps are replies in its thread
        notifier.post_status(ctl.store, ctl.status(sample_if_unmonitored=False), ctl.state_version())
        _say("2. an operator asks: train now? — the train-now guard answers:")
        try:
            ctl.start("train")
        except TrainGuardError as exc:
            _say("   " + train_guard_text(exc.completion))
        _say("3. arming auto-start instead; the monitor takes it from here")
        ctl.autostart(True, by="demo")
        thread.start()
        ok = _wait_for_training(ctl, notifier, interrupted)
        if ok:
            _final_post(ctl, notifier, interrupted)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if interrupted.is_set():
            _say("interrupted: stopping everything the demo started")
        monitor.stop()
        if thread.is_alive():
            thread.join(timeout=30)
        _flush(ctl, notifier, interrupted)
        ctl.stop_all(grace_s=5)
        ctl.close()
    if ok:
        _summary(root, ws, started)
        ok = _evaluate(root)
    _say("nothing left running." if ok else f"demo did not finish; see {log} and {root}/.eagle3/logs")
    return 0 if ok else 1


def _wait_for_training(ctl: Controller, notifier, interrupted: threading.Event) -> bool:
    """Post the status message (updated in place, as in Slack) every few seconds until training ends
    (False at once on Ctrl-C)."""
    deadline = time.monotonic() + TIMEOUT_S
    last_post = 0.0
    while time.monotonic() < deadline:
        if interrupted.wait(0.5):
            return False
        st = ctl.status(sample_if_unmonitored=False)
        ex = st.stages["extract"]
        if time.monotonic() - last_post >= POST_EVERY_S and ex.verdict in ("progressing", "slow"):
            last_post = time.monotonic()
            notifier.post_status(ctl.store, st, ctl.state_version())
        tr = st.stages["train"]
        if tr.state in ("exited", "stopped", "unknown"):
            ok = tr.state == "exited" and tr.exit_code == 0
            if not ok:
                _say(f"   training ended: {tr.reason}; its log ends: {_last_line(ctl)}")
            return ok
    _say(f"   training did not finish within {TIMEOUT_S:.0f} s")
    return False


def _final_post(ctl: Controller, notifier, interrupted: threading.Event, wait_s: float = 20.0) -> None:
    """The run's status post edited into its final render once the monitor judged training's end (as serve does)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not interrupted.is_set():
        due = notifier.final_due(ctl.store)
        if due:
            notifier.post_final(ctl.store, ctl.status(sample_if_unmonitored=False), *due)
            return
        interrupted.wait(0.5)


def _flush(ctl: Controller, notifier, interrupted: threading.Event, wait_s: float = 30.0) -> None:
    """Deliver what the outbox still holds (paced as Slack wants), for up to `wait_s`: the demo's last messages
    reach the channel before it exits."""
    deadline = time.monotonic() + wait_s
    while (time.monotonic() < deadline and not interrupted.is_set()
           and ctl.store.pending_messages(channel=notifier.channel)):
        notifier.tick(ctl.store)
        interrupted.wait(0.3)


def _last_line(ctl: Controller) -> str:
    """The training log's last line that says something (a failing rank's own error, under torchrun)."""
    _, lines = ctl.logs("train", lines=40)
    said = [line.strip() for line in lines if line.strip()]
    ours = [line for line in said if "train:" in line]  # the trainer's own one-line errors, whichever rank
    errors = [line for line in said if "Error" in line]  # else a traceback's last word
    return (ours or errors or said or ["(empty)"])[-1]


def _summary(root: Path, ws, started: float) -> None:
    m = summarize(root / "out")
    done, failed = m["done"], m["failed"]
    nbytes = sum(p.stat().st_size for p in (root / "out" / "hidden_states").glob("hs_*.safetensors"))
    ctl = Controller(workspace=ws)
    try:
        procs = {s: ctl.store.latest_proc(s) for s in STAGE_NAMES}
        steps = {e["data"]["step"]: e["t"] for e in ctl.store.events(kind="handoff")}
        first_step = next((o["t"] for o in ctl.store.observations(stage="train")
                           if (o.get("progress") or {}).get("done")), None)
    finally:
        ctl.close()
    lines = [json.loads(x) for x in (root / "ckpt" / "progress.jsonl").read_text().splitlines()]
    dur = {s: (p.ended_at or time.time()) - p.started_at for s, p in procs.items() if p and p.started_at}
    extract = procs["extract"]
    completion = extract.ended_at if extract and extract.ended_at else time.time()
    _say("\nsummary")
    _say(f"  samples: {done} extracted, {failed} failed; {nbytes / 1e6:.1f} MB of hidden states")
    _say("  time per stage: " + ", ".join(f"{s} {d:.0f} s" for s, d in dur.items()))
    marks = [("server stopped", steps.get(GPU_WAIT)), ("GPUs released", steps.get(LAUNCHING)),
             ("training's first step observed", first_step)]
    _say("  handoff after extraction completed: " + ", ".join(
        f"{name} +{t - completion:.1f} s" for name, t in marks if t))
    _say(f"  training kl: {lines[0]['kl']:.2f} at step 1 → {lines[-1]['kl']:.3f} at step {lines[-1]['step']}")
    charts = _charts(root, ws)
    if charts:
        _say("  charts: " + ", ".join(str(c) for c in charts))
    _say(f"  whole demo so far: {time.time() - started:.0f} s")


def _charts(root: Path, ws) -> list[Path]:
    """The run drawn from the store, as `eagle3 chart` draws it."""
    ctl = Controller(workspace=ws)
    try:
        run = ctl.store.latest_run()
        drawn = [render_run(ctl.store, stage, out=root / "charts" / f"{stage}.png", run=run,
                            title=f"eagle3 demo — {stage}, run {run}")[0] for stage in ("extract", "train")]
        return [p for p in drawn if p]
    finally:
        ctl.close()


def _evaluate(root: Path) -> bool:
    """Measure the exported draft the way SGLang serves it, against a fresh toy server."""
    import subprocess

    from pipeline.evaluate import evaluate, format_result

    draft = root / "ckpt" / "draft"
    _say(f"  draft for SGLang: {draft}")
    _say(f"  serve it with: {launch_line(draft, str(root / 'target'))}")
    _say("4. measuring the draft: chain speculation at depth 5 against the toy target's greedy continuations")
    server = subprocess.Popen([sys.executable, "-m", "bot.cli", "toy-server", "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert server.stdout is not None  # stdout=PIPE
    try:
        line = server.stdout.readline()
        if "listening on" not in line:
            _say(f"   the toy server did not start: {line.strip()}")
            return False
        url = line.split("listening on ")[1].split()[0]
        res = evaluate(draft_dir=draft, server=url, data=root / "data.jsonl", target_model=str(root / "target"),
                       depth=EVAL_DEPTH, prompts=EVAL_PROMPTS, new_tokens=EVAL_NEW_TOKENS, say=lambda _m: None)
    except UserError as exc:
        _say(f"   eval-draft: {exc}")
        return False
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    (root / "draft_eval.json").write_text(json.dumps(res, indent=1) + "\n")
    for text in format_result(res).splitlines():
        _say("   " + text)
    _say(f"  τ: draft {res['tau']:.2f}, bigram table {res['tau_bigram']:.2f}, without aux features "
         f"{res['tau_no_aux']:.2f} (details: {root / 'draft_eval.json'})")
    return True


if __name__ == "__main__":
    sys.exit(run_demo())
