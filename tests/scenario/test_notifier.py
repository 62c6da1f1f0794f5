"""The outbox: alerts, dedup, in-place status posts, nothing lost across an outage or a restart."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bot.app import slack_client
from bot.notifier import Notifier
from pipeline.config import Workspace, parse_config
from pipeline.status import RunStatus
from pipeline.store import Store
from tests.support.fake_slack import FakeSlack

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def env(tmp_path):
    fake = FakeSlack()
    ws = Workspace(config=parse_config('[slack]\nchannel = "C1"\noncall_user_ids = ["UONCALL"]\n', name="e.toml"),
                   path=tmp_path / "eagle3.toml")
    clock = {"t": 1_790_000_000.0}
    store = Store(ws.store_path, clock=lambda: clock["t"])

    def notifier(**kw):
        return Notifier(ws=ws, client=slack_client("xoxb-test", fake.url + "/api/"), clock=lambda: clock["t"],
                        **{"pace_s": 0.0, "host": "", **kw})

    yield {"ws": ws, "fake": fake, "store": store, "clock": clock, "notifier": notifier}
    store.close()
    fake.close()


def verdict(store, stage, frm, to, reasons=("no progress for 3m10s",)):
    store.add_event(kind="verdict", run_id="r1", stage=stage, data={"from": frm, "to": to, "reasons": list(reasons)})


def test_alert_mentions_oncall_is_not_repeated_while_open_and_a_stall_after_a_resolve_alerts_again(env):
    """The cooldown stops repeats of an alert that is still open (a restarted stage stalled again); once the alert
    is resolved, the next stall is news: it alerts at once, whatever the cooldown (a server that wedges, recovers
    and wedges again 4 minutes later is paged twice, and its recovery never arrives for an unannounced stall)."""
    n, store = env["notifier"](), env["store"]
    n.tick(store)  # first start: history is not re-posted
    verdict(store, "extract", "progressing", "stalled", ("no progress for 3m10s", "CPU time flat"))
    verdict(store, "extract", "stalled", "stalled")  # the same stall, seen again (its process restarted)
    verdict(store, "server", "progressing", "stopped")  # a requested stop is never an alert
    n.tick(store)
    texts = [c["text"] for c in env["fake"].of("chat.postMessage")]
    assert len(texts) == 1
    assert "<@UONCALL> *extract is stalled*" in texts[0] and "CPU time flat" in texts[0]
    verdict(store, "extract", "stalled", "progressing")
    n.tick(store)
    texts = [c["text"] for c in env["fake"].of("chat.postMessage")]
    assert len(texts) == 2 and "recovered: stalled → progressing" in texts[1]  # a reply under the alert
    assert "resolved after" in env["fake"].of("chat.update")[-1]["text"]
    env["clock"]["t"] += 240  # 4 minutes later, well within the 30-minute cooldown
    verdict(store, "extract", "progressing", "stalled", ("no progress for 1m20s",))
    n.tick(store)
    texts = [c["text"] for c in env["fake"].of("chat.postMessage")]
    assert len(texts) == 3 and "*extract is stalled*" in texts[2], "a stall after a resolve alerts again"


def test_outage_then_everything_delivered_in_order(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    fake.fail["chat.postMessage"] = 5
    for i in range(4):
        store.enqueue(channel="C1", kind="test", text=f"message {i}")
    for _ in range(12):
        n.tick(store)
        env["clock"]["t"] += 60
    assert [c["text"] for c in fake.of("chat.postMessage")] == [f"message {i}" for i in range(4)]
    assert store.pending_messages() == []


def test_pending_messages_survive_a_restart(env):
    store, fake = env["store"], env["fake"]
    env["notifier"]().tick(store)
    fake.fail["chat.postMessage"] = 1
    store.enqueue(channel="C1", kind="test", text="before the crash")
    env["notifier"]().tick(store)  # fails once; the service then dies
    env["clock"]["t"] += 60
    env["notifier"]().tick(store)  # a new process delivers it
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["before the crash"]


def not_started(run: str) -> RunStatus:
    """A run whose stages have not started yet."""
    return RunStatus.from_json({"run": run, "stages": {s: {"state": "not-started"} for s in ("server", "extract", "train")}})


def test_status_post_is_updated_in_place_and_steps_go_in_its_thread(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    status = not_started("r1")
    n.post_status(store, status, "r1:off")
    n.tick(store)
    store.add_event(kind="handoff", run_id="r1", data={"step": "stopping-server", "reason": "verified complete"})
    n.post_status(store, status, "r1:off")
    n.tick(store)
    posts, updates = fake.of("chat.postMessage"), fake.of("chat.update")
    first_ts = store.get("ts:status:r1")
    assert len(updates) == 1 and updates[0]["ts"] == first_ts
    reply = next(p for p in posts if "stopping-server" in p["text"])
    assert reply["thread_ts"] == first_ts


def test_milestones_once_each_and_only_the_open_runs(env):
    """Milestones belong to the run that reached them: a closed run's extraction verdict (what a restarted service
    finds, the next run not yet extracting) posts nothing, in no thread."""
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    run = store.open_run()
    for pct in (10.0, 26.0, 27.0, 80.0):
        store.put("verdict:extract", {"run": run, "progress_pct": pct})
        n.tick(store)
    passed = lambda: [c["text"] for c in fake.of("chat.postMessage") if "passed" in c["text"]]  # noqa: E731
    assert passed() == ["extract passed 25 %", "extract passed 50 %", "extract passed 75 %"]
    store.close_run(run, reason="all stages stopped")
    store.put("verdict:extract", {"run": run, "progress_pct": 100.0})
    n.tick(store)
    store.open_run()  # the next run, its extraction not started: the verdict is still the closed run's
    n.tick(store)
    assert passed() == ["extract passed 25 %", "extract passed 50 %", "extract passed 75 %"]


def test_escalation_once_and_snooze_silences(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    verdict(store, "extract", "progressing", "stalled")
    store.put("verdict:extract", {"verdict": "stalled", "run": "r1"})
    n.tick(store)
    env["clock"]["t"] += 1900
    n.tick(store)
    n.tick(store)
    texts = [c["text"] for c in fake.of("chat.postMessage")]
    assert len(texts) == 2 and "still stalled" in texts[1]
    assert "eagle3_snooze" in str(fake.of("chat.postMessage")[0]), "an alert offers Show logs / Snooze 1 h"
    store.put("snooze:train", env["clock"]["t"] + 3600)
    verdict(store, "train", "progressing", "dead")
    n.tick(store)
    assert len(fake.of("chat.postMessage")) == 2, "a snoozed stage does not alert"


def test_condition_alerts_become_messages(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    store.add_event(kind="condition-alert", run_id="r1", stage="extract",
                    data={"reason": "the run will not fit on disk: 2.10 TB still to write, 1.00 TB free"})
    n.tick(store)
    assert "will not fit on disk" in fake.of("chat.postMessage")[0]["text"]


def test_429_waits_out_retry_after_and_delivers_once(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    fake.script["chat.postMessage"] = [("429", 1)]
    store.enqueue(channel="C1", kind="test", text="rate limited once")
    n.tick(store)
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["rate limited once"]
    (_, fault, at), = fake.faults
    assert fault == "429" and fake.times[0] - at >= 0.9, "the retry came before Retry-After had passed"
    assert store.pending_messages() == []


def test_ok_false_permanent_error_is_kept_as_failed_and_does_not_block_the_channel(env, caplog):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    fake.script["chat.postMessage"] = [("error", "invalid_blocks")]
    first = store.enqueue(channel="C1", kind="test", text="refused by Slack")
    store.enqueue(channel="C1", kind="test", text="next one")
    n.tick(store)
    n.tick(store)
    row = store.db["outbox"].get(first)
    assert row["status"] == "failed" and row["last_error"] == "invalid_blocks"
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["next one"]
    assert "invalid_blocks" in caplog.text and "xoxb-test" not in caplog.text


@pytest.mark.parametrize("error", ["not_in_channel", "channel_not_found", "missing_scope"])
def test_a_fixable_refusal_waits_and_is_delivered_once_fixed(env, error):
    """Slack refuses until someone invites the bot (or adds the scope): nothing is dropped, order is kept,
    retries are slow, and `eagle3 status` says what to do."""
    from handlers.render.views import status_text
    from pipeline.controller import Controller

    n, store, fake = env["notifier"](fixable_retry_s=60.0), env["store"], env["fake"]
    n.tick(store)
    fake.script["chat.postMessage"] = [("error", error)] * 3
    store.enqueue(channel="C1", kind="test", text="first")
    store.enqueue(channel="C1", kind="test", text="second")
    for _ in range(3):  # within a minute: one try only
        n.tick(store)
        env["clock"]["t"] += 15
    assert len(fake.faults) == 1 and not fake.of("chat.postMessage")
    text = status_text(Controller(workspace=env["ws"], store=store).status(sample_if_unmonitored=False))
    assert f"slack: 2 message(s) waiting to be delivered (last error: {error}" in text
    assert {"not_in_channel": "invite the bot", "channel_not_found": "set [slack] channel",
            "missing_scope": "add the scope"}[error] in text
    for _ in range(4):  # still refused twice more, a minute apart; then Slack accepts
        env["clock"]["t"] += 61
        n.tick(store)
    assert len(fake.faults) == 3
    env["clock"]["t"] += 61
    n.tick(store)
    n.tick(store)
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["first", "second"]
    assert store.pending_messages() == [] and store.outbox_summary()["failed"] == 0


def test_network_failure_is_named_with_its_cause(env):
    from handlers.render.views import slack_hint

    n, store = env["notifier"](), env["store"]
    n.tick(store)
    env["fake"].close()  # nothing listens there any more
    store.enqueue(channel="C1", kind="test", text="while offline")
    n.tick(store)
    error = store.outbox_summary()["last_error"]
    assert error.startswith("network: URLError:") and "Connection refused" in error
    assert "cannot be reached from this host" in slack_hint(error)
    env["fake"] = FakeSlack()  # the fixture closes one


def test_ok_false_transient_error_is_retried_with_backoff(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    fake.script["chat.postMessage"] = [("error", "internal_error"), ("error", "service_unavailable")]
    store.enqueue(channel="C1", kind="test", text="eventually")
    n.tick(store)
    n.tick(store)  # still inside the backoff: no call
    assert len(fake.faults) == 1
    for _ in range(3):
        env["clock"]["t"] += 10
        n.tick(store)
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["eventually"]


def test_at_most_one_message_a_second_per_channel(env):
    n, store, fake = env["notifier"](pace_s=1.0), env["store"], env["fake"]
    n.tick(store)
    for i in range(3):
        store.enqueue(channel="C1", kind="test", text=f"m{i}")
    store.enqueue(channel="C2", kind="test", text="other channel")
    n.tick(store)
    n.tick(store)
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["m0"]  # C2 belongs to another notifier
    env["clock"]["t"] += 1.0
    n.tick(store)
    assert [c["text"] for c in fake.of("chat.postMessage")] == ["m0", "m1"]


def test_console_transport_prints_blocks_as_text_with_its_own_cursor(env, capsys):
    from bot.service import console_notifier

    store = env["store"]
    slack, console = env["notifier"](), console_notifier(env["ws"])
    console.clock, console.started_at = slack.clock, slack.started_at
    slack.tick(store)
    console.tick(store)
    verdict(store, "extract", "progressing", "stalled", ("no progress for 3m10s", "CPU time flat"))
    console.tick(store)
    slack.tick(store)
    out = capsys.readouterr().out
    assert "*extract is stalled* on `" in out and "\n    • no progress for 3m10s\n    • CPU time flat" in out
    assert "[ Show logs ]  [ Show stacks ]  [ Snooze 1 h ]" in out
    assert len(env["fake"].of("chat.postMessage")) == 1, "the console's dedup does not swallow Slack's alert"


def test_status_says_how_many_messages_wait_and_why(env):
    from handlers.render.views import status_text

    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    fake.script["chat.postMessage"] = [("error", "invalid_blocks"), ("500", None)]
    store.enqueue(channel="C1", kind="test", text="refused")
    store.enqueue(channel="C1", kind="test", text="waiting")
    store.enqueue(channel="console", kind="test", text="printed locally")
    n.tick(store)
    n.tick(store)
    assert store.outbox_summary() == {"pending": 1, "failed": 1, "last_error": "HTTP 500"}
    text = status_text(RunStatus(run=None, outbox=store.outbox_summary(), stages={}))
    assert "slack: 1 message(s) waiting to be delivered, 1 refused by Slack for good (last error: HTTP 500; " in text


def test_alert_evidence_quoting_a_log_is_redacted(env, monkeypatch):
    token = "-".join(["xoxb", "42", "leaked"])
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    verdict(store, "extract", "progressing", "dead", (f"exited with code 1; its log says: auth failed for {token}",))
    n.tick(store)
    text = fake.of("chat.postMessage")[0]["text"]
    assert "its log says: auth failed for [redacted]" in text and token not in text


def test_events_from_before_the_start_are_history_but_the_first_ticks_own_are_posted(env):
    store, fake = env["store"], env["fake"]
    verdict(store, "extract", "progressing", "stalled")  # before this service started: in /eagle3 status only
    env["clock"]["t"] += 1
    n = env["notifier"]()
    store.add_event(kind="reminder", run_id="r1", data={"by": "cli:root", "status": {}})  # made by the first tick
    n.tick(store)
    assert [c["text"] for c in fake.of("chat.postMessage")] == [
        "checking back as asked by cli:root: no stage observed yet"]


@pytest.mark.parametrize("answer", ["invalid_auth", "ok"])
def test_serve_checks_its_token_once_at_start(env, answer, caplog):
    from bot.service import Delivery
    from handlers.render.views import status_text
    from pipeline.controller import Controller

    if answer != "ok":
        env["fake"].script["auth.test"] = [("error", answer)]
    delivery = Delivery(ws=env["ws"], notifier=env["notifier"]())
    with caplog.at_level("INFO", logger="eagle3.service"):
        delivery.check_auth()
    assert delivery.auth_checked and len(env["fake"].faults) + len(env["fake"].of("auth.test")) == 1
    stored = env["store"].get("slack_auth")
    if answer == "ok":
        assert stored["ok"] is True and "the bot token works" in caplog.text
        return
    assert stored == {"ok": False, "error": "invalid_auth"}
    assert "Slack refused the bot token (invalid_auth)" in caplog.text and "xoxb-test" not in caplog.text
    status = Controller(workspace=env["ws"], store=env["store"]).status(sample_if_unmonitored=False)
    assert "slack: the bot token was refused (invalid_auth); SLACK_BOT_TOKEN is not valid" in status_text(
        replace(status, slack_auth=stored))


def _observed(store, clock, samples=300):
    """A run with a simulated extraction in the store, the clock at its last observation."""
    from pipeline.toy.simtrace import Scenario, simulate

    run = store.open_run()
    for o in simulate(Scenario("chart", samples=samples)).observations:
        store.add_observation(o, run_id=run)
        clock["t"] = o["t"]
    return run


UPLOAD_FLOW = ["files.getUploadURLExternal", "upload", "files.completeUploadExternal"]


def test_milestone_charts_upload_in_order_and_survive_an_outage(env):
    n, store, fake, clock = env["notifier"](), env["store"], env["fake"], env["clock"]
    run = _observed(store, clock)
    n.tick(store)
    n.post_status(store, not_started(run), "v")
    n.tick(store)
    fake.fail["files.getUploadURLExternal"] = 2  # Slack down for the first attempts
    fake.fail["upload"] = 1  # then the upload URL answers 500 once
    store.put("verdict:extract", {"run": run, "progress_pct": 30.0})
    for _ in range(8):
        n.tick(store)
        clock["t"] += 60
    flow = [m for m, _ in fake.calls if m in UPLOAD_FLOW]
    # the failed upload's URL is abandoned and the flow starts again: one file posted, nothing lost or doubled
    assert flow == UPLOAD_FLOW[:1] + UPLOAD_FLOW, flow
    assert [f[0] for f in fake.faults] == ["files.getUploadURLExternal"] * 2 + ["upload"]
    assert fake.of("upload")[0]["png"] and fake.of("upload")[0]["bytes"] > 10_000
    done = fake.of("files.completeUploadExternal")[0]
    assert done["initial_comment"] == "extract passed 25 %" and done["thread_ts"] == store.get("ts:status:" + run)
    assert done["channel_id"] == "C1"
    files = done["files"] if isinstance(done["files"], list) else json.loads(done["files"])
    assert files[0]["title"].endswith("(times in UTC)"), files  # the alt text is the upload URL request's
    assert "times in UTC" in json.dumps(fake.of("files.getUploadURLExternal")[-1])
    assert store.pending_messages() == []
    assert store.get("chart:latest")["file_id"] == fake.of("upload")[0]["file_id"]
    assert any(p.suffix == ".png" for p in (env["ws"].state_dir / "charts").iterdir())


def test_a_stall_alert_carries_the_last_hour_in_its_thread(env):
    n, store, fake, clock = env["notifier"](), env["store"], env["fake"], env["clock"]
    run = _observed(store, clock)
    n.tick(store)
    store.add_event(kind="verdict", run_id=run, stage="extract",
                    data={"from": "progressing", "to": "stalled", "reasons": ["no progress for 2m"]})
    n.tick(store)
    alert = fake.of("chat.postMessage")[0]
    done = fake.of("files.completeUploadExternal")
    assert "*extract is stalled*" in alert["text"] and len(done) == 1
    assert done[0]["thread_ts"].startswith("1790000000.") and done[0]["initial_comment"] == "extract, the last hour"


def test_without_files_write_the_chart_text_is_posted_and_the_scope_named_once(env):
    n, store, fake, clock = env["notifier"](), env["store"], env["fake"], env["clock"]
    run = _observed(store, clock)
    n.tick(store)
    fake.script["files.getUploadURLExternal"] = [("error", "missing_scope")] * 2
    for pct in (30.0, 60.0):
        store.put("verdict:extract", {"run": run, "progress_pct": pct})
        n.tick(store)
    texts = [c["text"] for c in fake.of("chat.postMessage")]
    assert texts[0].startswith("extract passed 25 %\n") and "`files:write`" in texts[0]
    assert texts[1] == "extract passed 50 %", "the scope is named once"
    assert store.pending_messages() == []


def test_a_chart_request_becomes_an_upload(env):
    from pipeline.controller import Controller

    n, store, fake, clock = env["notifier"](), env["store"], env["fake"], env["clock"]
    n.tick(store)
    ctl = Controller(workspace=env["ws"], store=store)
    with pytest.raises(Exception, match="nothing observed of train"):
        ctl.request_chart("train", by="slack:U1")
    _observed(store, clock, samples=100)
    ctl.request_chart("extract", by="slack:U1")
    n.tick(store)
    assert [m for m, _ in fake.calls if m in UPLOAD_FLOW] == UPLOAD_FLOW
    assert fake.of("files.completeUploadExternal")[0]["initial_comment"] == "extract, as <@U1> asked"


def test_the_status_post_is_edited_on_a_verdict_change_within_min_edit_s_and_not_more_often(env):
    """Issue 35: a change of verdict, stage state or handoff step edits the post within min_edit_s (10 s); the
    changes within that time make one edit, with the latest state."""
    n, store, fake, clock = env["notifier"](host="gpu-017"), env["store"], env["fake"], env["clock"]
    run = store.open_run()

    def one_pass():  # what the delivery thread does each second
        if n.needs_status(store):
            n.post_status(store, not_started(run), f"{run}:off")
        n.tick(store)

    one_pass()
    assert len(fake.of("chat.postMessage")) == 1 and "on `gpu-017`" in json.dumps(fake.of("chat.postMessage")[0])
    edits = []
    changes = {1: "progressing", 2: "slow", 3: "stalled", 12: "progressing"}
    for second in range(1, 26):
        to = changes.get(second)
        clock["t"] += 1.0
        if to:
            store.put("verdict:extract", {"verdict": to, "run": run, "proc_id": 1})
        before = len(fake.of("chat.update"))
        one_pass()
        if len(fake.of("chat.update")) > before:
            edits.append(second)
    assert edits == [10, 20], edits  # the first change waits out min_edit_s from the post; three make one edit
    assert len(fake.of("chat.update")) == 2


def test_a_recovery_resolves_the_alert_in_place_with_the_details_in_its_thread(env):
    n, store, fake, clock = env["notifier"](host="gpu-017"), env["store"], env["fake"], env["clock"]
    n.tick(store)
    verdict(store, "extract", "progressing", "stalled", ("no progress for 3m10s",))
    n.tick(store)
    alert = fake.of("chat.postMessage")[0]
    assert "*extract is stalled* on `gpu-017`" in alert["text"]
    ts = store.get("ts:" + store.get("open-alert:extract")["key"])
    clock["t"] += 600
    verdict(store, "extract", "stalled", "progressing", ("last progress 2s ago",))
    n.tick(store)
    update = fake.of("chat.update")[-1]
    assert update["ts"] == ts and "resolved after 10m" in update["text"] and update["text"].startswith("~")
    reply = fake.of("chat.postMessage")[-1]
    assert reply["thread_ts"] == ts and "recovered on `gpu-017`: stalled → progressing" in reply["text"]
    assert len(fake.of("chat.postMessage")) == 2  # the alert and its reply: no new top-level message


def test_endings_are_broadcast_to_the_channel_and_name_the_host(env):
    """(How long the stage ran is in the same line: tests/integration/test_monitor.py, over a real stage.)"""
    n, store, fake = env["notifier"](host="gpu-017"), env["store"], env["fake"]
    n.tick(store)
    n.post_status(store, not_started("r1"), "r1:off")
    n.tick(store)
    store.add_event(kind="verdict", run_id="r1", stage="extract",
                    data={"from": "progressing", "to": "done", "reasons": ["exited 0 with 40 / 40 done"]})
    store.add_event(kind="handoff", run_id="r1", data={"step": "training-done",
                                                       "reason": "training finished (exit 0); draft: /ckpt/draft"})
    n.tick(store)
    done, trained = fake.of("chat.postMessage")[-2:]
    for m in (done, trained):
        assert m["reply_broadcast"] is True and m["thread_ts"] == store.get("ts:status:r1") and "`gpu-017`" in m["text"]
    assert "*extract is done* on `gpu-017`" in done["text"] and "draft: /ckpt/draft" in trained["text"]


def test_the_status_post_gets_a_final_render_when_the_run_ends(env):
    """When the run closes, its status post is edited one last time: each stage's ending, duration, samples and
    loss, no live button — once each stage's end is judged (the run closes at training's exit, a tick before the
    monitor judges it)."""
    from pipeline.controller import Controller
    from pipeline.verdict import StoredVerdict

    n, store, fake = env["notifier"](), env["store"], env["fake"]
    ctl = Controller(workspace=env["ws"], store=store)
    run = store.open_run()
    t0 = env["clock"]["t"]
    ex = store.insert_proc({"run_id": run, "stage": "extract", "state": "exited", "exit_code": 0, "argv": "[]",
                            "started_at": t0 - 3600, "ended_at": t0 - 600, "stop_requested": 0})
    store.put_verdict("extract", StoredVerdict.from_json({"proc_id": ex, "verdict": "done", "done": 300, "failed": 0,
                                                          "total": 300, "reasons": ["exited 0"], "final": True}))
    tr = store.insert_proc({"run_id": run, "stage": "train", "state": "running", "argv": "[]",
                            "started_at": t0 - 600, "stop_requested": 0})
    n.post_status(store, ctl.status(sample_if_unmonitored=False), ctl.state_version())
    n.tick(store)
    assert fake.of("chat.postMessage")[-1]["blocks"][-1]["type"] == "actions", "the live post has its buttons"
    store.update_proc(tr, state="exited", exit_code=0, ended_at=t0)
    store.close_run(run, reason="training finished (exit 0)")
    assert n.final_due(store) is None, "training's end is not judged yet"
    store.put_verdict("train", StoredVerdict.from_json({"proc_id": tr, "verdict": "done", "done": 60, "total": 60,
                                                        "reasons": ["exited 0"], "final": True}))
    store.add_observation({"t": t0, "stage": "train", "progress": {"done": 60, "total": 60, "unit": "steps",
                                                                   "loss": 0.8123, "acc_by_depth": [0.61, 0.42],
                                                                   "validated_at_step": 60},
                           "gpus": [{"index": 0}, {"index": 1}]}, run_id=run)
    due = n.final_due(store)
    assert due is not None and due[0] == run
    n.post_final(store, ctl.status(sample_if_unmonitored=False), *due)
    n.tick(store)
    final = fake.of("chat.update")[-1]
    text = final["blocks"][0]["text"]["text"]
    assert f"*Run {run}*" in text and "ended*: training finished (exit 0)" in text
    assert "*extract*: done after 50m" in text and "300 / 300" in text
    assert "*train*: done after 10m" in text and "final loss 0.8123" in text and "top-1 by depth 0.61, 0.42" in text
    # τ from the validation's top-1 by depth (1 + 0.61 + 0.61 × 0.42), and the GPUs it held for its 10 minutes
    assert "τ ≈ 1.87 (depth 2, simulated from validation)" in text and "2 GPUs, 0.33 GPU-h" in text, text
    assert "0.33 GPU-hours in all" in text
    assert all(b["type"] != "actions" for b in final["blocks"]), "no live button on an ended run"
    assert n.final_due(store) is None, "once"


def test_progress_alone_edits_the_status_post_within_min_edit_s_not_every_30_minutes(env):
    """A run whose verdict stays `progressing` for an hour: its post follows the progress (to a tenth of a
    percent), at most once per min_edit_s — not only at the 30-minute refresh."""
    n, store, fake, clock = env["notifier"](), env["store"], env["fake"], env["clock"]
    run = store.open_run()
    n.post_status(store, not_started(run), f"{run}:off")
    n.tick(store)
    edits = 0
    for second in range(1, 61):
        clock["t"] += 1.0
        store.put("verdict:extract", {"verdict": "progressing", "run": run, "proc_id": 1,
                                      "progress_pct": 60.0 + second * 0.05})
        if n.needs_status(store):
            n.post_status(store, not_started(run), f"{run}:off")
            edits += 1
        n.tick(store)
    assert 5 <= edits <= 6 and len(fake.of("chat.update")) == edits  # a minute of moving progress, min_edit_s 10 s


def test_an_escalation_is_a_broadcast_reply_in_the_alerts_thread_and_is_resolved_with_it(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    verdict(store, "extract", "progressing", "stalled")
    store.put("verdict:extract", {"verdict": "stalled", "run": "r1"})
    n.tick(store)
    alert = fake.of("chat.postMessage")[0]
    env["clock"]["t"] += 1900
    n.tick(store)
    escalation = fake.of("chat.postMessage")[1]
    assert "still stalled" in escalation["text"] and escalation.get("reply_broadcast") is True
    assert escalation["thread_ts"], "in the alert's thread"
    assert alert.get("thread_ts") is None
    verdict(store, "extract", "stalled", "progressing")
    n.tick(store)
    updated = [u["text"] for u in fake.of("chat.update")]
    assert any(t.startswith("~:rotating_light:") and "is stalled" in t for t in updated), "the alert resolved"
    assert any(t.startswith("~:rotating_light:") and "still stalled" in t and "resolved after" in t
               for t in updated), "its escalation resolved in place too"


def test_one_ending_for_training_that_auto_start_followed_and_who_did_what_as_mentions(env):
    """Training's end is broadcast once — auto-start's training-done, with the draft and how long it took — not
    also as "train is done"; "armed by slack:U…" reads as a mention."""
    from pipeline.states import HandoffState, HandoffStep

    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    store.put_handoff(HandoffState(run="r1", step=HandoffStep.TRAINING))
    store.add_event(kind="handoff", run_id="r1", data={"step": "armed", "reason": "armed by slack:U0ONCALL"})
    verdict(store, "train", "progressing", "done", ("exited 0 with 60 / 60 done",))
    store.add_event(kind="handoff", run_id="r1", data={"step": "training-done", "reason": "training finished (exit 0)"})
    n.tick(store)
    texts = [c["text"] for c in fake.of("chat.postMessage")]
    assert not any("*train is done*" in t for t in texts)
    assert sum("training-done" in t for t in texts) == 1
    assert any("armed by <@U0ONCALL>" in t for t in texts) and not any("slack:U0ONCALL" in t for t in texts)


def test_an_acknowledged_stall_is_not_escalated_and_keeps_its_text_with_who_is_on_it(env):
    from handlers.render.alerts import ACTION_ACK, acknowledged_blocks
    from pipeline.controller import Controller

    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    verdict(store, "extract", "progressing", "stalled")
    store.put("verdict:extract", {"verdict": "stalled", "run": "r1"})
    n.tick(store)
    alert = fake.of("chat.postMessage")[0]
    assert ACTION_ACK in json.dumps(alert["blocks"]), "a stall alert offers Acknowledge"
    env["clock"]["t"] += 60
    Controller(workspace=env["ws"], store=store).acknowledge("extract", by="slack:UONCALL")
    env["clock"]["t"] += 1900
    n.tick(store)
    assert len(fake.of("chat.postMessage")) == 1, "taken by someone: no escalation"
    blocks = acknowledged_blocks(alert["blocks"], "UONCALL", env["clock"]["t"])
    text = json.dumps(blocks)
    assert "<@UONCALL> is on it since" in text and ACTION_ACK not in text and "is stalled" in text
    assert [e["data"]["by"] for e in store.events(kind="acknowledged")] == ["slack:UONCALL"]


def test_a_stall_that_ends_without_a_recovery_resolves_its_alert_and_its_ending_still_posts(env):
    """Stalled → done (the server came back and extraction finished within a tick) or stalled → stopped (a restart
    by hand): the alert is resolved in place, with how it ended under it; it never stays open for ever."""
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    verdict(store, "extract", "progressing", "stalled")
    n.tick(store)
    env["clock"]["t"] += 75
    verdict(store, "extract", "stalled", "done", ("exited 0 with 80 / 80 done",))
    n.tick(store)
    n.tick(store)
    assert "resolved after 1m" in fake.of("chat.update")[-1]["text"]
    replies = [p["text"] for p in fake.of("chat.postMessage") if p.get("thread_ts")]
    assert any("extract: stalled → done (exited 0" in r for r in replies), replies
    assert any("*extract is done*" in p["text"] for p in fake.of("chat.postMessage")), "its ending is still said"


def test_a_handoff_step_is_told_once_however_often_its_reason_changes(env):
    n, store, fake = env["notifier"](), env["store"], env["fake"]
    n.tick(store)
    for reason in ("waiting for verified completion", "waiting: manifest unreadable", "waiting: 9 of 80 processed"):
        store.add_event(kind="handoff", run_id="r1", data={"step": "waiting-for-completion", "reason": reason})
    store.add_event(kind="handoff", run_id="r1", data={"step": "stopping-server", "reason": "verified complete"})
    n.tick(store)
    texts = [p["text"] for p in fake.of("chat.postMessage")]
    assert [t.split(" — ")[0] for t in texts] == ["auto-start: *waiting-for-completion*",
                                                   "auto-start: *stopping-server*"], texts


def test_a_reasons_ago_becomes_a_date_token_that_stays_true():
    from handlers.render.alerts import live_ago

    assert live_ago("• last progress 3m12s ago", 1_000_000.0) == "• last progress <!date^999808^{ago}|at 13:43 UTC>"
    assert live_ago("• last progress 0s ago; no progress for 8s", 100.0).startswith("• last progress <!date^100^")
    assert live_ago("nothing ago here", 5.0) == "nothing ago here" and live_ago("2h05m ago", None) == "2h05m ago"


def test_who_chose_what_on_the_status_post_stays_through_the_next_edit(env):
    """A click's note ("<@U> chose *Auto-start training* …") is part of the post from then on: the change-driven
    edit a second later re-renders the post with it, not without it; another run's choice is not shown."""
    from pipeline.controller import Controller

    n, store, fake = env["notifier"](), env["store"], env["fake"]
    ctl = Controller(workspace=env["ws"], store=store)
    run = store.open_run()
    store.audit(user="slack:UOK", channel="C1", action="Auto-start training", outcome="done", detail="armed")
    store.audit(user="slack:UOK", channel="C1", action="Snooze 1 h", outcome="done", detail="not a status button")
    n.post_status(store, ctl.status(sample_if_unmonitored=False), ctl.state_version())
    n.tick(store)
    shown = str(fake.of("chat.postMessage")[-1]["blocks"])
    assert "<@UOK> chose *Auto-start training* at <!date^" in shown and ": armed" in shown, shown
    store.close_run(run, reason="all stages stopped")
    env["clock"]["t"] += 10
    run2 = store.open_run()
    n.post_status(store, ctl.status(sample_if_unmonitored=False), ctl.state_version())
    n.tick(store)
    assert run2 != run and "chose" not in str(fake.of("chat.postMessage")[-1]["blocks"])


def test_the_datas_template_preview_goes_once_into_the_runs_thread_as_its_first_data_stage_starts(tmp_path):
    """Issue 51: `eagle3 prepare` keeps its first conversation, rendered with the trained tokens in ⟦…⟧, in the
    sidecar; the run's thread shows it when extraction (or regeneration) starts — a wrong mask is seen before
    terabytes are extracted. Once per run; data without a sidecar shows nothing."""
    fake = FakeSlack()
    ws = Workspace(config=parse_config('[slack]\nchannel = "C1"\n[stages.extract]\nargv = ["x"]\ndata = "d.jsonl"\n',
                                       name="e.toml"), path=tmp_path / "eagle3.toml")
    (tmp_path / "d.jsonl").write_text("{}\n")
    (tmp_path / "d.meta.json").write_text(json.dumps({"preview": {"id": "c1", "tokens": 12, "trained": 4,
                                                                  "text": "<|user|>hi<|assistant|>⟦yo!<|end|>⟧"}}))
    store = Store(ws.store_path)
    try:
        n = Notifier(ws=ws, client=slack_client("xoxb-test", fake.url + "/api/"), pace_s=0.0, host="")
        run = store.open_run()
        from pipeline.controller import Controller

        ctl = Controller(workspace=ws, store=store)
        n.post_status(store, ctl.status(sample_if_unmonitored=False), ctl.state_version())
        n.tick(store)
        assert not [p for p in fake.of("chat.postMessage") if "Template check" in p["text"]], "no data stage yet"
        store.insert_proc({"run_id": run, "stage": "extract", "state": "running", "argv": "[]", "started_at": 1.0,
                           "stop_requested": 0})
        n.tick(store)
        n.tick(store)
        shown = [p for p in fake.of("chat.postMessage") if "Template check" in p["text"]]
        assert len(shown) == 1 and shown[0]["thread_ts"] and "⟦yo!<|end|>⟧" in shown[0]["text"], shown
        assert "c1, 12 tokens, 4 trained on" in shown[0]["text"]
    finally:
        store.close()
        fake.close()


def test_a_stall_gathers_its_evidence_into_the_alerts_thread_and_show_stacks_gathers_again(env):
    """Issue 52: at the stall, `eagle3 why`'s evidence is gathered (beside the tick: the real notifier uses a thread
    of its own; inline here), kept under forensics/, and uploaded into the alert's thread with its summary as the
    comment; Show stacks (a stacks-request) gathers again into the same thread."""
    asked = []
    n = env["notifier"](gatherer=lambda notifier, *a: (asked.append(a), notifier._gather_now(*a)))
    store, fake = env["store"], env["fake"]
    n.tick(store)
    verdict(store, "extract", "progressing", "stalled")
    n.tick(store)
    n.tick(store)
    alert_ts = next(f"1790000000.{i + 1:06d}" for i, (m, p) in enumerate(fake.calls)
                    if m == "chat.postMessage" and "*extract is stalled*" in p.get("text", ""))
    assert [a[0] for a in asked] == ["extract"] and asked[0][3] == "at the stall"
    uploads = [p for p in fake.of("files.completeUploadExternal") if "Evidence of extract" in p.get("initial_comment", "")]
    assert len(uploads) == 1 and uploads[0]["thread_ts"] == alert_ts, fake.of("files.completeUploadExternal")
    assert "extract: no live process to read" in uploads[0]["initial_comment"]
    kept = list((env["ws"].state_dir / "forensics").rglob("evidence.txt"))
    assert len(kept) == 1 and kept[0].read_text().startswith("eagle3 why extract")
    store.add_event(kind="stacks-request", run_id="r1", stage="extract", data={"by": "slack:U1"})
    n.tick(store)
    n.tick(store)
    again = [p for p in fake.of("files.completeUploadExternal") if "asked by slack:U1" in p.get("initial_comment", "")]
    assert len(again) == 1 and again[0]["thread_ts"] == alert_ts


def test_py_spy_held_for_30_s_never_holds_the_tick(env, monkeypatch, tmp_path):
    """Issue 52: a py-spy that hangs for 30 s on a real stage process (a real binary that sleeps): the notifier's
    tick (the monitor's thread, under the console transport and the demo) keeps its cadence while the gathering
    waits beside it; the gathering gives py-spy up at its bound, says so, and the rest of the evidence arrives."""
    import subprocess
    import sys
    import time

    import psutil

    from pipeline.observe import forensics

    stage = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\nexec sleep 30\n")
    spy.chmod(0o755)
    monkeypatch.setattr(forensics, "pyspy_binary", lambda: str(spy))
    n, store, fake = env["notifier"](), env["store"], env["fake"]  # the real gatherer: a thread of its own
    try:
        run = store.open_run()
        store.insert_proc({"run_id": run, "stage": "extract", "state": "running", "pid": stage.pid, "pgid": stage.pid,
                           "create_time": psutil.Process(stage.pid).create_time(), "argv": "[]", "started_at": 1.0,
                           "stop_requested": 0})
        n.tick(store)
        store.add_event(kind="verdict", run_id=run, stage="extract",
                        data={"from": "progressing", "to": "stalled", "reasons": ["no progress for 3m10s"]})
        took, deadline = [], time.monotonic() + 40

        def evidence():
            return [p for p in fake.of("files.completeUploadExternal") if "Evidence of extract" in
                    p.get("initial_comment", "")]

        while not evidence() and time.monotonic() < deadline:
            t0 = time.monotonic()
            n.tick(store)
            took.append(time.monotonic() - t0)
            time.sleep(0.5)
    finally:
        stage.kill()
        stage.wait()
    said = evidence()
    assert said and "stacks: py-spy did not answer within 10 s" in said[0]["initial_comment"], said
    # ~20 ticks while py-spy was held (at least 8 on a loaded machine), none of them waiting for it: a tick is
    # milliseconds, the hold 10 s (a tick that waited for the gathering would take all of it, and be the only one)
    assert len(took) >= 8 and max(took) < 3.0, took
