"""`eagle3 regenerate` and the regenerate stage (issue 34), against the toy server over real HTTP."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, eagle3, wait_for

pytestmark = pytest.mark.timeout(240)
ARGS = ["--temperature", "0", "--max-new-tokens", "6", "--concurrency", "4"]
STEPS = 24  # the end to end's training: enough for a draft that SGLang loads and that is measured


def done_rows(parts: Path) -> int:
    try:
        conn = sqlite3.connect(f"file:{parts / 'manifest.sqlite'}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT COUNT(*) FROM samples WHERE status = 'done'").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def test_kill_9_mid_run_then_resume_writes_each_conversation_once(tmp_path):
    """Killed with SIGKILL part way, started again: OUT equals an uninterrupted run's, line for line and in order."""
    from pipeline.toy.demo_workspace import write_dataset
    from tests.toy import ToyServer

    write_dataset(tmp_path / "in.jsonl", 40, turns=True)
    server = ToyServer("--latency-ms", "30")
    try:
        common = ["regenerate", "--server", server.url, "--data", str(tmp_path / "in.jsonl"), *ARGS]
        ref = eagle3(*common, "--out", str(tmp_path / "ref.jsonl"), timeout=120)
        assert ref.returncode == 0, ref.stderr
        out = tmp_path / "out.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "bot.cli", *common, "--out", str(out)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        parts = tmp_path / "out.jsonl.parts"
        wait_for(lambda: done_rows(parts) >= 8, timeout=60, what="8 conversations regenerated")
        proc.kill()
        proc.wait()
        before = done_rows(parts)
        assert before < 40 and not out.exists()  # OUT is written once, whole, at the end
        res = eagle3(*common, "--out", str(out), timeout=120)
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    assert f"{before:,} already regenerated" in res.stderr
    lines, ref_lines = out.read_text().splitlines(), (tmp_path / "ref.jsonl").read_text().splitlines()
    assert lines == ref_lines and len(lines) == 40
    rows = [json.loads(x) for x in lines]
    assert [r["id"] for r in rows] == [f"demo-{i}" for i in range(40)]
    src = [json.loads(x) for x in (tmp_path / "in.jsonl").read_text().splitlines()]
    for new, old in zip(rows, src, strict=True):
        assert len(new["input_ids"]) == len(new["loss_mask"])
        assert new["input_ids"] != old["input_ids"] and new["input_ids"][-1] == 255  # the target's answers, closed
        assert new["input_ids"][: old["loss_mask"].index(1)] == old["input_ids"][: old["loss_mask"].index(1)]


@pytest.mark.timeout(420)
def test_from_a_chat_file_to_a_measured_draft(tmp_path):
    """The end to end on the toy (issue 34): a ShareGPT file prepared with the toy target's tokenizer and chat
    template; regeneration watched in status; with auto-start armed, extraction starts once regeneration is
    verified complete, exactly once, the server still up; then the handoff stops the server and trains; the
    exported draft's τ is measured as SGLang serves it."""
    from pipeline.config import load_workspace
    from pipeline.controller import Controller
    from pipeline.evaluate import evaluate
    from pipeline.monitor import Monitor
    from pipeline.toy.demo_workspace import write_demo_workspace
    from tests.toy import ToyServer

    cfg = write_demo_workspace(tmp_path / "ws", regenerate=True, samples=32, steps=STEPS)
    # one training process: torchrun's two are the demo's and test_train's to prove; this one's story is the chain
    cfg.write_text(cfg.read_text().replace('"--nproc-per-node", "2"', '"--nproc-per-node", "1"'))
    ws = load_workspace(cfg)
    ctl = Controller(workspace=ws)
    monitor = Monitor(ws=ws)
    thread = threading.Thread(target=monitor.run, daemon=True)
    progress, seen = [], {}
    try:
        ctl.start("server")
        ctl.start("regenerate")
        ctl.autostart(True, by="test")
        thread.start()

        def watched() -> bool:
            st = ctl.status(sample_if_unmonitored=False)
            regen = st.stages["regenerate"]
            if regen.progress_pct is not None:
                progress.append((regen.verdict, regen.progress_pct, regen.done, regen.total))
            if "extract" not in seen and ctl.store.latest_proc("extract") is not None:
                seen["server"] = ctl.store.latest_proc("server")  # as extraction starts (32 samples may end in 2 s)
                time.sleep(2)  # more ticks: a second launch would show now
                seen["extract"] = list(ctl.store.procs("extract"))
            train = ctl.store.latest_proc("train")
            return train is not None and train.state == "exited"

        wait_for(watched, timeout=330, interval=0.3, what="extraction, then training, started by auto-start and done")
        chain = ctl.store.events(kind="chain")
        train = ctl.store.latest_proc("train")
    finally:
        monitor.stop()
        thread.join(timeout=30)
        ctl.stop_all(grace_s=2)
        ctl.close()
    assert any(v in ("progressing", "slow") and 0 < pct < 100 and total == 32 for v, pct, _, total in progress), progress
    assert len(chain) == 1 and "all 32 conversations regenerated" in chain[0]["data"]["reason"]
    assert len(seen["extract"]) == 1 and seen["server"].state == "running" and not seen["server"].stop_requested
    assert (cfg.parent / "regenerated.jsonl").read_text().count("\n") == 32
    assert train.exit_code == 0
    server = ToyServer()
    try:
        res = evaluate(draft_dir=cfg.parent / "ckpt" / "draft", server=server.url, data=cfg.parent / "regenerated.jsonl",
                       target_model=str(cfg.parent / "target"), depth=5, prompts=8, new_tokens=32, say=lambda m: None)
    finally:
        server.stop()
    assert res["prompts_measured"] >= 4 and res["tau"] >= 1.0, res  # τ counts the target's own token
    print(f"τ after {STEPS} steps on 32 regenerated conversations: {res['tau']:.2f} (bigram {res['tau_bigram']:.2f})")


def test_completion_weighs_failed_conversations_by_the_handoffs_share(tmp_path):
    """A malformed line fails for good: the run still writes OUT and exits 0, and completion decides by the share."""
    from pipeline.regenerate import complete
    from pipeline.toy.demo_workspace import write_dataset
    from tests.toy import ToyServer

    write_dataset(tmp_path / "in.jsonl", 9, turns=True)
    with open(tmp_path / "in.jsonl", "a") as fh:
        fh.write('{"id": "bad", "input_ids": [1, 2, 3]}\n')  # no loss_mask: no assistant turn to regenerate
    server = ToyServer()
    try:
        res = eagle3("regenerate", "--server", server.url, "--data", str(tmp_path / "in.jsonl"), "--out",
                     str(tmp_path / "out.jsonl"), *ARGS, timeout=120)
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    assert "9 conversations" in res.stderr and "1 failed" in res.stderr
    assert complete(tmp_path / "out.jsonl") == (False, "1 conversation(s) failed, more than 0 % of 10; run "
                                                       "regenerate again to retry them")
    ok, why = complete(tmp_path / "out.jsonl", max_failed_share=0.1)
    assert ok and "(1 failed, within 10 %)" in why


def test_a_cut_turn_is_answered_again_in_full_and_only_the_templates_end_of_turn_stops_an_answer(tmp_path):
    """Issue 51: `prepare --max-length` cuts some conversations inside their last assistant turn, which then ends on
    ordinary content. The stop tokens come from the chat template (prepare's OUT.meta.json), never from a turn's
    last token: every request the toy server logs asks to stop at special tokens only, and every regenerated turn
    ends with the end of turn — the target's own (trained) or, at --max-new-tokens, closed (not trained)."""
    from pipeline.prepare import load_tokenizer, prepare, read_meta
    from pipeline.regenerate import assistant_runs
    from pipeline.toy.demo_workspace import write_chat
    from pipeline.toy.model import export_target
    from tests.toy import ToyServer

    export_target(tmp_path / "target")
    write_chat(tmp_path / "chat.jsonl", 16)
    data = tmp_path / "data.jsonl"
    summary = prepare(target_model=str(tmp_path / "target"), data=tmp_path / "chat.jsonl", out=data, max_length=90,
                      say=lambda m: None)
    special = set(load_tokenizer(str(tmp_path / "target"), trust_remote_code=False).all_special_ids)
    eot = read_meta(data)["end_of_turn_ids"]
    assert eot and set(eot) <= special, eot
    src = [json.loads(x) for x in data.read_text().splitlines()]
    cut = [r for r in src if r["loss_mask"][-1] == 1 and r["input_ids"][-1] not in eot]
    assert summary.cut and cut, "some last turns were cut inside their content"
    log = tmp_path / "requests.jsonl"
    server = ToyServer("--log-requests", str(log))
    try:
        res = eagle3("regenerate", "--server", server.url, "--data", str(data), "--out", str(tmp_path / "out.jsonl"),
                     "--temperature", "0.8", "--max-new-tokens", "12", "--concurrency", "4", timeout=120)
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    assert f"stop tokens (end of turn): {eot}, read off the chat template by eagle3 prepare" in res.stderr
    sent = [json.loads(x)["sampling_params"]["stop_token_ids"] for x in log.read_text().splitlines()]
    assert sent and all(s == eot for s in sent), {tuple(s) for s in sent}
    for row in (json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()):
        ids, mask = row["input_ids"], row["loss_mask"]
        for _, end in assistant_runs(mask):
            # the target's own end of turn (trained), or one closing an answer cut at --max-new-tokens (not)
            assert ids[end - 1] in eot or (end < len(ids) and ids[end] in eot and mask[end] == 0), row["id"]
    assert read_meta(tmp_path / "out.jsonl")["end_of_turn_ids"] == eot


def test_with_the_target_model_each_turns_history_is_rendered_through_the_template_as_serving_does(tmp_path):
    """Issue 51: `regenerate --target-model` sends, for every assistant turn, the chat template's rendering of the
    history — the earlier turns with the target's own answers — and its generation prompt (what SGLang's chat
    endpoint would build), checked request by request against the template rendered here; the written
    conversation is the template's tokens, trained on the target's answers only."""
    from pipeline.prepare import Renderer, load_tokenizer, prepare
    from pipeline.regenerate import assistant_runs
    from pipeline.toy.demo_workspace import write_chat
    from pipeline.toy.model import export_target
    from tests.toy import ToyServer

    export_target(tmp_path / "target")
    write_chat(tmp_path / "chat.jsonl", 6)
    data = tmp_path / "data.jsonl"
    prepare(target_model=str(tmp_path / "target"), data=tmp_path / "chat.jsonl", out=data, say=lambda m: None)
    log = tmp_path / "requests.jsonl"
    server = ToyServer("--log-requests", str(log), "--answer-tokens", "10")  # answers that end, so turns follow
    try:
        res = eagle3("regenerate", "--server", server.url, "--data", str(data), "--out", str(tmp_path / "out.jsonl"),
                     "--target-model", str(tmp_path / "target"), "--temperature", "0.8", "--max-new-tokens", "24",
                     "--concurrency", "1", timeout=120)
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    assert "re-rendering each turn's history through the chat template" in res.stderr
    tok = load_tokenizer(str(tmp_path / "target"), trust_remote_code=False)
    renderer = Renderer(tok)
    sent = [json.loads(x)["input_ids"] for x in log.read_text().splitlines()]
    chats = [json.loads(x) for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(sent) == sum(sum(t["from"] == "gpt" for t in c["conversations"]) for c in chats)  # one a turn
    k = 0
    for chat, row in zip(chats, rows, strict=True):  # concurrency 1: requests in conversation order
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in chat["conversations"]]
        answers = []  # the target's answers, read back out of the written conversation's trained runs
        for start, end in assistant_runs(row["loss_mask"]):
            answers.append(tok.decode(row["input_ids"][start:end - 1], skip_special_tokens=False))
        history = []
        for turn in turns:
            if turn["role"] != "assistant":
                history.append(turn)
                continue
            expected = tok(renderer.render(history, generation_prompt=True), add_special_tokens=False)["input_ids"]
            assert sent[k] == list(expected), (chat["id"], k)
            history.append({"role": "assistant", "content": answers[len([h for h in history
                                                                         if h["role"] == "assistant"])]})
            k += 1
        again = renderer.prepare(history, max_length=None)
        assert row["input_ids"] == again.input_ids and row["loss_mask"] == again.loss_mask
