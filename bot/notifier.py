"""Events → outbox → Slack. Nothing is lost across a restart or an outage.

Each event worth posting becomes an outbox row in the same transaction that moves
the notifier's cursor past it; a row is marked sent only after Slack accepts it.
Delivery keeps order per channel, paces at about one message a second, and backs
off on errors; a 429 is honoured by slack_sdk's RateLimitErrorRetryHandler.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

from bot.console import ConsoleClient
from handlers.render.alerts import (
    ENDINGS,
    alert_buttons,
    chart_request_text,
    escalation_text,
    event_message,
    milestone_text,
    resolved_text,
)
from handlers.render.blocks import choice_note, final_blocks, status_blocks, text_blocks
from handlers.render.views import tau_text
from handlers.verbs import LABELS, STATUS_ACTIONS
from pipeline.config import PLACEHOLDER, STAGE_NAMES, Workspace
from pipeline.handoff.machine import handoff_state
from pipeline.manifest import mass_line
from pipeline.observe import forensics
from pipeline.observe.charts import alt_text, render_run
from pipeline.prepare import read_meta
from pipeline.states import TRAINING, TRAINING_DONE, TRAINING_FAILED, StateVersion
from pipeline.status import RunStatus
from pipeline.store import KV, Store
from pipeline.verdict import Verdict

log = logging.getLogger("eagle3.notifier")
MILESTONES = (25, 50, 75, 100)
STALL_CHART_S = 3600.0  # a stall alert carries the chart of the last hour
CHARTS_KEPT = 20  # rendered charts stay in STATE_DIR/charts for the operator; older ones are removed
SCOPE_NOTE = ("(the chart was not posted: the app lacks the `files:write` scope; add it under OAuth & "
              "Permissions and reinstall the app)")
RETRYABLE = {"internal_error", "fatal_error", "service_unavailable", "request_timeout", "ratelimited"}
# Refusals a person can fix (invite the bot, add a scope, replace the token): the message waits
# and is retried slowly, never dropped; `eagle3 status` says what to do (handlers.render.views.slack_hint).
FIXABLE = {"not_in_channel", "channel_not_found", "missing_scope", "is_archived", "invalid_auth", "not_authed",
           "token_revoked", "account_inactive", "no_permission"}


def status_signature(store: Store) -> str:
    """What the status post shows that is worth an edit (at most one per `min_edit_s`): each stage's verdict,
    process state and progress to a tenth of a percent, the run and the handoff step (ETA drift is the periodic
    refresh's; "last progress … ago" is a Slack date token that stays current by itself)."""
    handoff = handoff_state(store)
    parts: list = [store.current_run(), str(handoff.step if handoff and handoff.step else "off")]
    for stage in STAGE_NAMES:
        v, p = store.verdict(stage), store.latest_proc(stage)
        pct = v.progress_pct if v is not None and v.progress_pct is not None else None
        parts.append((stage, v and v.verdict, v and v.proc_id, p.state if p else None,
                      None if pct is None else round(pct, 1)))
    return json.dumps(parts, default=str)


class Notifier:
    """One per service; `tick(store)` from the monitor's thread."""

    def __init__(self, *, ws: Workspace, client: WebClient | ConsoleClient, clock=time.time, cooldown_s: float = 1800.0,
                 pace_s: float = 1.0, escalate_s: float | None = None, channel: str | None = None,
                 key_prefix: str = "", fixable_retry_s: float = 60.0, host: str | None = None,
                 gatherer=None) -> None:
        """`channel`/`key_prefix` let the console transport keep its own cursor, dedup and message ids."""
        self.ws, self.client, self.clock = ws, client, clock
        self.cooldown_s, self.pace_s = cooldown_s, pace_s
        self.escalate_s = escalate_s if escalate_s is not None else ws.config.slack.escalate_after_min * 60
        channel = channel or ws.config.slack.channel
        self.channel = channel if channel and not PLACEHOLDER.search(channel) else None
        self.k = key_prefix
        self.fixable_retry_s = fixable_retry_s
        self.started_at = clock()
        self.last_sent: dict[str, float] = {}
        self.host = host if host is not None else socket.gethostname()  # named in what reaches the channel
        self.min_edit_s = ws.config.slack.min_edit_s
        self.status_posted: tuple[str, float] | None = None  # (signature, when) of the last status enqueued
        # how evidence is gathered: in a thread of its own (tests: inline)
        self.gatherer = gatherer or (lambda n, *a: threading.Thread(target=n._gather_now, args=a, daemon=True,
                                                                       name="eagle3-forensics").start())

    @property
    def to(self) -> str:
        """The channel messages are queued for: set whenever anything is queued (`tick` and the posts return early
        without one)."""
        if not self.channel:
            raise RuntimeError("the notifier has no channel: nothing may be queued")
        return self.channel

    def tick(self, store: Store) -> None:
        """Collect new events, add milestone replies, deliver what is pending."""
        if not self.channel:
            return
        self.collect(store)
        self.escalate(store)
        self.milestones(store)
        self.preview(store)
        self.deliver(store)

    def collect(self, store: Store) -> None:
        after = store.get(self.k + KV.NOTIFIER_AFTER)
        if after is None:  # first start: history from before it is in `/eagle3 status`, not re-posted
            older = [e["id"] for e in store.events() if e["t"] < self.started_at]
            after = older[-1] if older else 0
            store.put(self.k + KV.NOTIFIER_AFTER, after)
        gathers: list[tuple] = []  # evidence to gather once this event's transaction has committed
        for event in store.events(after_id=after):
            stage, run = event.get("stage"), event.get("run_id")
            msg = event_message(event, oncall=self.ws.config.slack.oncall_user_ids,
                                patterns=self.ws.config.slack.redact_patterns, host=self.host,
                                took_s=self._took(store, event))
            if msg and msg[0] == "ending" and event["kind"] == "verdict" and self._handoff_ends(store, stage, run):
                msg = None  # auto-start's own ending says it, with the draft and how long it took: one ending
            if msg and msg[0] == "ending" and stage == "extract" and event["kind"] == "verdict":
                mass = mass_line((store.latest_observation("extract") or {}).get("progress") or {})
                msg = (msg[0], msg[1] + f"\n• {mass}", msg[2]) if mass else msg
            if msg and msg[0] == "ending" and (stage == "train" or event["kind"] == "handoff"):
                tau = tau_text((store.latest_observation("train") or {}).get("progress"))
                msg = (msg[0], msg[1] + f"\n• {tau} (simulated; `eagle3 eval-draft` measures it)", msg[2]) if tau \
                    else msg
            if msg and msg[0] == "handoff" and event["kind"] == "handoff" and run:
                step = event["data"].get("step")
                if store.get(self.k + KV.step_told(run)) == step:
                    msg = None  # a new reason within the same step (what it waits for) is the status post's news
                store.put(self.k + KV.step_told(run), step)
            self._log(event, msg)
            with store.atomic():
                if stage and msg and msg[0] == "recovery" and self._resolve(store, stage, msg[1], event):
                    msg = None  # the alert itself now says it is resolved; the details are a reply under it
                elif stage and self._stall_ended(event):  # done, stopped or restarted while stalled: no alert stays open
                    d = event["data"]
                    self._resolve(store, stage, f"{stage}: {d.get('from')} → {d.get('to')} "
                                                f"({'; '.join(d.get('reasons') or [])})", event)
                if msg and not self._duplicate(store, event, msg[0]):
                    kind, text, thread = msg
                    blocks = text_blocks(text) + (alert_buttons(stage) if kind == "alert" and stage else [])
                    opens = kind == "alert" and stage and event["kind"] == "verdict"
                    mid = store.enqueue(channel=self.to, kind=kind, text=text, blocks=blocks,
                                        thread_key=f"status:{run}" if thread and run else None,
                                        update_key=f"alert:{event['id']}" if opens else None)
                    if opens:  # resolved in place when the stage recovers
                        store.put(self.k + KV.open_alert(stage), {"key": f"alert:{event['id']}", "t": event["t"],
                                                                   "text": text})
                    if kind == "alert" and stage and event["data"].get("to") == "stalled":
                        store.enqueue(channel=self.to, kind="chart", text=f"{stage}, the last hour",
                                      thread_key=f"outbox:{mid}",
                                      attachment={"chart": stage, "run": run, "since": event["t"] - STALL_CHART_S})
                    if kind == "alert" and stage and event["data"].get("to") in ("stalled", "dead"):
                        gathers.append((stage, run, f"outbox:{mid}", "at the stall"))
                elif event["kind"] == "stacks-request" and stage:
                    open_alert = store.get(self.k + KV.open_alert(stage))
                    gathers.append((stage, run, open_alert["key"] if open_alert else (f"status:{run}" if run else None),
                                    f"asked by {event['data'].get('by', 'someone')}"))
                elif event["kind"] == "chart-request" and stage:
                    store.enqueue(channel=self.to, kind="chart",
                                  text=chart_request_text(stage, event["data"].get("by", "someone")),
                                  thread_key=f"status:{run}" if run else None,
                                  attachment={"chart": stage, "run": run, "text_if_none": True})
                store.put(self.k + KV.NOTIFIER_AFTER, event["id"])
            for stage_, run_, key, why in gathers:  # after the transaction: the gathering writes with its own
                self.gather(stage_, run_, thread_key=key, why=why)
            gathers.clear()

    def gather(self, stage: str, run: str | None, *, thread_key: str | None, why: str) -> None:
        """`eagle3 why STAGE`, now, beside the monitor's tick and the delivery (its own thread and store
        connection; up to forensics.GATHER_BUDGET_S): the evidence is kept under STATE_DIR/forensics/, and its
        summary, with the whole as a text file, becomes a reply in `thread_key`'s thread."""
        self.gatherer(self, stage, run, thread_key, why)

    def _gather_now(self, stage: str, run: str | None, thread_key: str | None, why: str) -> None:
        store = Store(self.ws.store_path, check_integrity=False)
        try:
            ev = forensics.gather(self.ws.for_run(run), store, stage)
            path = forensics.keep(self.ws, ev, run)
            text = f"Evidence of {stage}, gathered {why} (`eagle3 why {stage}`):\n" + "\n".join(
                f"• {line}" for line in ev.summary or ["nothing to report"])
            store.enqueue(channel=self.to, kind="forensics", text=text, thread_key=thread_key,
                          attachment={"file": str(path), "title": f"eagle3 why {stage}"} if isinstance(path, Path)
                          else None)
        except Exception:  # noqa: BLE001 - evidence is a help, never a failure of the service
            log.exception("gathering the evidence of %s failed", stage)
        finally:
            store.close()

    @staticmethod
    def _stall_ended(event: dict) -> bool:
        """A verdict event that leaves a stuck verdict for one that is not (its alert is resolved by it)."""
        if event["kind"] != "verdict":
            return False
        frm, to = Verdict.of(event["data"].get("from")), Verdict.of(event["data"].get("to"))
        return bool(frm and frm.stuck and not (to and to.stuck))

    @staticmethod
    def _handoff_ends(store: Store, stage: str | None, run: str | None) -> bool:
        """Training whose end auto-start follows (it posts training-done or -failed): its verdict is no second
        ending in the channel."""
        state = handoff_state(store)
        return stage == "train" and state is not None and state.run == run and state.step in (
            TRAINING, TRAINING_DONE, TRAINING_FAILED)

    @staticmethod
    def _log(event: dict, msg) -> None:
        """Verdict changes and what the channel is told, one line each in serve's log: the record that is left
        when Slack and Prometheus are both down."""
        d = event["data"]
        if event["kind"] == "verdict":
            log.info("run %s: %s %s → %s (%s)", event.get("run_id"), event.get("stage"), d.get("from"), d.get("to"),
                     "; ".join(d.get("reasons") or []))
        elif msg and msg[0] in ("alert", "recovery", "ending", "warning"):
            log.info("run %s: %s: %s", event.get("run_id"), msg[0], msg[1].split("\n", 1)[0])

    def _took(self, store: Store, event: dict) -> float | None:
        """How long the ending stage ran (a stage's done verdict, or training's end in the handoff)."""
        d = event["data"]
        stage = event.get("stage") if event["kind"] == "verdict" and d.get("to") == "done" else (
            "train" if event["kind"] == "handoff" and d.get("step") in ENDINGS else None)
        if not stage:
            return None
        proc = store.latest_proc(stage)
        if not proc or not proc.started_at:
            return None
        # from the run's first start of the stage: a restart in between does not reset what it took
        first = min((p.started_at for p in store.procs(stage) if p.run_id == proc.run_id and p.started_at),
                    default=proc.started_at)
        return (proc.ended_at or event["t"]) - first

    def _resolve(self, store: Store, stage: str, text: str, event: dict) -> bool:
        """Update the stage's open alert to "resolved after N" and reply under it with `text`; False when no
        alert of this stage is open (the recovery is then a message of its own)."""
        alert = store.get(self.k + KV.open_alert(stage))
        if not alert:
            return False
        acked = store.get(KV.acked(stage)) or {}
        taken = acked.get("by") if acked.get("t", -1.0) >= alert["t"] else None
        resolved = resolved_text(alert["text"], event["t"] - alert["t"], taken_by=taken)
        store.enqueue(channel=self.to, kind="resolved", text=resolved, blocks=text_blocks(resolved),
                      update_key=alert["key"])
        escalation = f"escalation:{alert['key']}"
        if store.has_message(channel=self.to, update_key=escalation):  # its escalation is resolved with it
            said = escalation_text(stage, self.escalate_s, self.ws.config.slack.oncall_user_ids, self.host)
            done = resolved_text(said, event["t"] - alert["t"], taken_by=taken)
            store.enqueue(channel=self.to, kind="resolved", text=done, blocks=text_blocks(done),
                          update_key=escalation)
        store.enqueue(channel=self.to, kind="recovery", text=text, thread_key=alert["key"])
        store.put(self.k + KV.open_alert(stage), None)
        # the cooldown stops repeats of an alert still open; once resolved, the next stall is news again
        store.put(self.k + KV.alerted(stage, "stalled"), None)
        return True

    def _duplicate(self, store: Store, event: dict, kind: str) -> bool:
        """Alerts repeat at most once per cooldown for the same stage and cause, and not while snoozed."""
        if kind != "alert":
            return False
        if (store.get(KV.snooze(event.get("stage"))) or 0) > self.clock():
            return True
        key = self.k + KV.alerted(event.get("stage"), event["data"].get("to") or event["data"].get("reason", "")[:40])
        last = store.get(key)
        if last is not None and self.clock() - last < self.cooldown_s:
            return True
        store.put(key, self.clock())
        return False

    def escalate(self, store: Store) -> None:
        """One reminder when a stage is still stalled `escalate_s` after its alert."""
        for stage in STAGE_NAMES:
            v = store.verdict(stage)
            alerted = store.get(self.k + KV.alerted(stage, "stalled"))
            key = self.k + KV.escalated(stage, alerted)
            if v is None or v.verdict != "stalled" or alerted is None or store.get(key):
                continue
            acked = store.get(KV.acked(stage)) or {}
            if acked.get("t", -1.0) >= alerted:  # someone took this alert: no escalation
                continue
            if self.clock() - alerted >= self.escalate_s and (store.get(KV.snooze(stage)) or 0) <= self.clock():
                store.put(key, True)
                text = escalation_text(stage, self.clock() - alerted, self.ws.config.slack.oncall_user_ids, self.host)
                open_alert = store.get(self.k + KV.open_alert(stage))
                # a reply in the alert's thread, broadcast to the channel, resolved in place with the alert
                store.enqueue(channel=self.to, kind="escalation", text=text,
                              blocks=text_blocks(text) + alert_buttons(stage),
                              thread_key=open_alert["key"] if open_alert else None,
                              update_key=f"escalation:{open_alert['key']}" if open_alert else None)

    def milestones(self, store: Store) -> None:
        """25/50/75/100 % of extraction, once each per run, as replies in the run's thread."""
        v = store.verdict("extract")
        run, pct = (v.run, v.progress_pct) if v else (None, None)
        if not run or pct is None or run != store.current_run():
            return  # a closed run's figures are that run's: never posted again, nor into another run's thread
        passed = store.get(self.k + KV.milestones(run), [])
        for m in MILESTONES:
            if pct >= m and m not in passed:
                passed.append(m)
                store.enqueue(channel=self.to, kind="milestone", text=milestone_text("extract", m),
                              thread_key=f"status:{run}",
                              attachment={"chart": "extract", "run": run, "text_if_none": True})
        store.put(self.k + KV.milestones(run), passed)

    def preview(self, store: Store) -> None:
        """Once per run, as its first data stage (regeneration or extraction) starts: the first conversation of the
        data as `eagle3 prepare` rendered it, the trained tokens in ⟦…⟧, in the run's thread — a wrong template or
        mask is seen before terabytes are extracted from it. Nothing where the data has no prepare sidecar."""
        run = store.current_run()
        if not run or store.get(self.k + KV.previewed(run)):
            return
        for stage in ("regenerate", "extract"):
            if store.latest_proc(stage, run=run) is None:
                continue
            store.put(self.k + KV.previewed(run), True)  # once, whether or not there is a preview
            ws = self.ws.for_run(run)
            data = ws.resolve(getattr(ws.config.stages, stage).data)
            shown = ((read_meta(data) or {}).get("preview") if data else None) or {}
            if data is not None and shown.get("text"):
                text = (f"Template check — {stage} reads `{data.name}`; its first conversation ({shown.get('id')}, "
                        f"{shown.get('tokens', 0):,} tokens, {shown.get('trained', 0):,} trained on) as the chat "
                        f"template renders it, the trained tokens in ⟦…⟧:\n```{shown['text']}```")
                store.enqueue(channel=self.to, kind="preview", text=text, thread_key=f"status:{run}")
            return

    def needs_status(self, store: Store) -> bool:
        """True when a run is open and its status message was never enqueued (a run just started), or what it
        shows changed (a verdict, a stage's state, the handoff step) and the last edit is `min_edit_s` old: the
        changes within that time make one edit (the latest state), never one edit each."""
        run = store.current_run()
        if not (self.channel and run):
            return False
        if not store.has_message(channel=self.to, update_key=f"status:{run}"):
            return True
        if self.status_posted is None:  # a restarted service: the next change refreshes it
            self.status_posted = (status_signature(store), self.clock())
            return False
        signature, at = self.status_posted
        return self.clock() - at >= self.min_edit_s and status_signature(store) != signature

    FINAL_WAIT_S = 120.0  # how long the final render waits for the closed run's last verdicts

    def final_due(self, store: Store) -> tuple[str, str | None, float] | None:
        """(run, why it closed, when) when the last closed run's status post has not had its final render for this
        closing yet (a reopened run that closes again gets another): once each of its stages' end is judged (or
        FINAL_WAIT_S after it closed), and only while no newer run is open."""
        closed = store.last_closed_run()
        if not self.channel or not closed or store.current_run() is not None:
            return None
        run, reason, closed_at = closed
        if store.get(self.k + KV.final_status(run)) == closed_at or not store.has_message(
                channel=self.channel, update_key=f"status:{run}"):
            return None
        ends = [(p, store.verdict(s)) for s in STAGE_NAMES if (p := store.latest_proc(s, run=run)) is not None]
        judged = all(v is not None and v.proc_id == p.id and v.final for p, v in ends if p.has_ended)
        return closed if judged or self.clock() - closed_at >= self.FINAL_WAIT_S else None

    def post_final(self, store: Store, status: RunStatus, run: str, reason: str | None, closed_at: float) -> None:
        """Edit the closed run's status post into its final render (no buttons), once per closing."""
        text, blocks = final_blocks(status, run=run, closed=reason, host=self.host, now=self.clock())
        store.enqueue(channel=self.to, kind="status", text=text, blocks=blocks, update_key=f"status:{run}")
        store.put(self.k + KV.final_status(run), closed_at)

    def post_status(self, store: Store, status: RunStatus, version: StateVersion) -> None:
        """Enqueue the run's status message; delivery updates it in place after the first post."""
        if not self.channel:
            return
        # who chose what on it stays on it (a click's note is not overwritten by the next change-driven edit)
        chose = store.last_choice([LABELS[a] for a in STATUS_ACTIONS], run=status.run) if status.run else None
        note = choice_note(chose["user"], chose["action"], chose["t"], chose["detail"]) if chose else None
        text, blocks = status_blocks(status, version=version, host=self.host, note=note)
        store.enqueue(channel=self.to, kind="status", text=text, blocks=blocks,
                      update_key=f"status:{status.run}")
        self.status_posted = (status_signature(store), self.clock())

    def deliver(self, store: Store) -> None:
        blocked: set[str] = set()
        for m in store.pending_messages(channel=self.channel):
            ch = m["channel"]
            if ch in blocked:
                continue  # keep order per channel
            if m["next_try"] > self.clock() or self.clock() - self.last_sent.get(ch, 0.0) < self.pace_s:
                blocked.add(ch)
                continue
            try:
                ts = self._send(store, m)
            except SlackApiError as exc:
                code = exc.response.status_code
                error = f"HTTP {code}" if code >= 500 or not isinstance(exc.response.data, dict) else (
                    exc.response.get("error") or f"HTTP {code}")
                if error == "missing_scope" and exc.response.get("needed"):
                    error += f" (needed: {exc.response.get('needed')})"
                self._failed(store, m, error, retry=code >= 500 or error in RETRYABLE,
                             fixable=error.split(" ")[0] in FIXABLE)
                blocked.add(ch)
                continue
            except (OSError, SlackRequestError) as exc:  # network, or the file upload refused: retry with backoff
                self._failed(store, m, f"network: {type(exc).__name__}: {exc}", retry=True)
                blocked.add(ch)
                continue
            self.last_sent[ch] = self.clock()
            with store.atomic():
                store.mark_sent(m["id"], ts=ts)
                if m["update_key"] and store.get(self.k + KV.ts(m["update_key"])) is None:
                    store.put(self.k + KV.ts(m["update_key"]), ts)

    def _thread_ts(self, store: Store, key: str | None) -> str | None:
        if not key:
            return None
        if key.startswith("outbox:"):
            return store.message_ts(int(key.split(":", 1)[1]))
        return store.get(self.k + KV.ts(key))

    def _send(self, store: Store, m: dict) -> str | None:
        spec = json.loads(m["attachment"]) if m.get("attachment") else None
        if spec and spec.get("file"):
            return self._send_file(store, m, spec)
        if spec:
            return self._send_chart(store, m, spec)
        blocks = json.loads(m["blocks"]) or None
        existing = store.get(self.k + KV.ts(m["update_key"])) if m["update_key"] else None
        if existing:
            self.client.chat_update(channel=m["channel"], ts=existing, text=m["text"], blocks=blocks)
            return existing
        thread = self._thread_ts(store, m["thread_key"])
        # endings and escalations reach the channel from their thread
        broadcast = True if thread and m["kind"] in ("ending", "escalation") else None  # None: not sent
        r = self.client.chat_postMessage(channel=m["channel"], text=m["text"], blocks=blocks, thread_ts=thread,
                                         reply_broadcast=broadcast)
        return r.get("ts")

    def _send_chart(self, store: Store, m: dict, spec: dict) -> str | None:
        """Render the chart now (from what the store holds at delivery) and upload it with
        files_upload_v2 (files.getUploadURLExternal, the upload, files.completeUploadExternal), the
        message's text as its comment. Nothing to draw: the text alone, or nothing for a chart-only
        message. No `files:write` scope: the text, with what to fix said once."""
        stage, thread = spec["chart"], self._thread_ts(store, m["thread_key"])
        out = self.ws.state_dir / "charts" / f"{stage}-{m['id']}.png"
        try:
            png, _, _ = render_run(store, stage, out=out, run=spec.get("run"), since=spec.get("since"))
        except Exception as exc:  # noqa: BLE001 - a chart that cannot be drawn must not hold up the channel
            log.warning("chart of %s could not be drawn (%s: %s); posting the text alone", stage,
                        type(exc).__name__, exc)
            png = None
        if png is None:
            if not spec.get("text_if_none"):
                return None
            return self.client.chat_postMessage(channel=m["channel"], text=m["text"], thread_ts=thread).get("ts")
        self._prune(out.parent)
        try:
            r = self.client.files_upload_v2(channel=m["channel"], file=str(png), filename=png.name,
                                            title=f"eagle3 — {stage} (times in UTC)", alt_txt=alt_text(stage),
                                            initial_comment=m["text"], thread_ts=thread)
        except SlackApiError as exc:
            if not isinstance(exc.response.data, dict) or exc.response.get("error") != "missing_scope":
                raise
            noted = store.get(self.k + KV.CHART_SCOPE_NOTED)
            store.put(self.k + KV.CHART_SCOPE_NOTED, True)
            text = m["text"] if noted else f"{m['text']}\n{SCOPE_NOTE}"
            log.warning("chart upload refused: missing_scope (needed: %s)", exc.response.get("needed") or "files:write")
            return self.client.chat_postMessage(channel=m["channel"], text=text, thread_ts=thread).get("ts")
        file = r.get("file") or {}
        store.put(self.k + KV.CHART_LATEST, {"file_id": file.get("id"), "stage": stage, "t": self.clock(),
                                            "path": str(png)})
        return None

    def _send_file(self, store: Store, m: dict, spec: dict) -> str | None:
        """A kept file (the evidence of `eagle3 why`) uploaded into the message's thread with its text as the
        comment; the text alone when the file is gone or the files:write scope is missing."""
        thread, path = self._thread_ts(store, m["thread_key"]), Path(spec["file"])
        if path.is_file():
            try:
                self.client.files_upload_v2(channel=m["channel"], file=str(path), filename=path.name,
                                            title=spec.get("title") or path.name, initial_comment=m["text"],
                                            thread_ts=thread)
                return None
            except SlackApiError as exc:
                if not isinstance(exc.response.data, dict) or exc.response.get("error") != "missing_scope":
                    raise
        return self.client.chat_postMessage(channel=m["channel"], text=f"{m['text']}\n(kept in `{path}`)",
                                            thread_ts=thread).get("ts")

    @staticmethod
    def _prune(directory) -> None:
        charts = sorted(directory.glob("*.png"), key=lambda p: p.stat().st_mtime)
        for old in charts[:-CHARTS_KEPT]:
            old.unlink(missing_ok=True)

    def _failed(self, store: Store, m: dict, error: str, *, retry: bool, fixable: bool = False) -> None:
        attempts = m["attempts"] + 1
        log.warning("slack delivery of message %s failed (%s); %s", m["id"], error,
                    "waiting for it to be fixed" if fixable else "will retry" if retry else "giving up")
        delay = self.fixable_retry_s if fixable else min(300.0, 2.0 ** attempts)
        store.mark_failed(m["id"], attempts=attempts, error=error, retry=retry or fixable,
                          next_try=self.clock() + delay)
