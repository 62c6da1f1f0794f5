"""Buttons: auto-start, cancel, check back later, stop/restart. A button whose action has become meaningless
changes nothing and is answered with the state as it is now. "Check back later" is read-only: anyone in an
allowed channel may press it (it sets a reminder for the channel, nothing else)."""

from __future__ import annotations

import json
import socket
import time

from handlers.auth import TRAIL
from handlers.render.alerts import (
    ACTION_ACK,
    ACTION_LOGS,
    ACTION_SNOOZE,
    ACTION_STACKS,
    acknowledged_blocks,
)
from handlers.render.blocks import (
    ACTION_AUTOSTART,
    ACTION_CANCEL,
    ACTION_CONFIRM,
    ACTION_KEEP,
    ACTION_LATER,
    ACTION_TRAIN,
    choice_note,
    status_blocks,
    text_blocks,
)
from handlers.render.views import SLASH, autostart_text, slack_time, stop_text
from handlers.slash import answer, train_later
from handlers.verbs import LABELS, STATUS_ACTIONS
from pipeline.errors import UserError
from pipeline.states import TRAINING, TRAINING_DONE, StateVersion


def register(app, *, controller_factory, ws) -> None:
    """Attach the button listeners."""

    def handle(ack, body, client, respond, context):
        ack()
        action = (body.get("actions") or [{}])[0]
        action_id = action.get("action_id", "")
        user = (body.get("user") or {}).get("id", "?")
        channel = (body.get("channel") or {}).get("id")
        trail = context[TRAIL]  # the middleware's: who clicked, where, which button
        ctl = controller_factory()
        later = None  # slow work (a stop's grace period, verifying sample files): run after the message is updated
        try:
            moot = meaningless(ctl, action_id, action)
            if moot:  # drawn for a state that has passed: say so, with the state as it is now
                trail.record(ctl, "stale", moot)
                text, blocks = status_blocks(ctl.status(sample_if_unmonitored=False), version=ctl.state_version(),
                                             note=f"{LABELS.get(action_id, action_id)}: {moot}")
                return respond(text=f"{moot}. {text}", blocks=blocks, response_type="ephemeral",
                               replace_original=False)
            if action_id == ACTION_TRAIN:
                trail.record(ctl, "accepted", what="train")
                later = lambda: train_later(controller_factory, user, respond)  # noqa: E731
                result = "verifying sample files, then starting training…"
            elif action_id == ACTION_CONFIRM:
                trail.record(ctl, "confirmed", what=_describe(action))
                later = lambda: _stop_later(controller_factory, action, user, respond)  # noqa: E731
                result = f"{_describe(action)} requested; I'll report when it is done"
            else:
                try:
                    result = _act(ctl, action_id, action, user)
                except UserError as exc:  # e.g. a snooze for a stage that does not exist
                    result = str(exc)
            trail.record(ctl, "done", result)
            text = choice_note(user, LABELS[action_id], time.time(), result)
            if action_id == ACTION_ACK:  # the alert stays the alert, with who is on it
                blocks = acknowledged_blocks((body.get("message") or {}).get("blocks"), user, time.time())
                text = (body.get("message") or {}).get("text") or text
            elif action_id in STATUS_ACTIONS:  # the status post stays the status post, with the outcome in it
                _, blocks = status_blocks(ctl.status(sample_if_unmonitored=False), version=ctl.state_version(),
                                          note=text)
            else:
                blocks = text_blocks(text)
        finally:
            ctl.close()
        container = body.get("container") or {}
        if container.get("is_ephemeral") or not container.get("message_ts"):
            respond(text=text, blocks=blocks, replace_original=True)
        else:
            client.chat_update(channel=channel, ts=container["message_ts"], text=text, blocks=blocks)
        if later:  # Slack had its ack long ago: this runs on in Bolt's bounded listener pool, no thread of our own
            later()

    for action_id in LABELS:
        app.action(action_id)(handle)

    @app.action(ACTION_STACKS)
    def show_stacks(ack, body, respond):  # read-only: gathered beside the tick, answered in the alert's thread
        ack()
        stage = ((body.get("actions") or [{}])[0].get("value")) or "extract"
        user = (body.get("user") or {}).get("id", "?")
        ctl = controller_factory()
        try:
            ctl.request_stacks(stage, by=f"slack:{user}")
        except UserError as exc:
            return respond(text=str(exc), response_type="ephemeral", replace_original=False)
        finally:
            ctl.close()
        respond(text=f"gathering {stage}'s stacks, the server's view and its log's end; they come in the alert's "
                     "thread (`eagle3 why` does the same from a shell)", response_type="ephemeral",
                replace_original=False)

    @app.action(ACTION_LOGS)
    def show_logs(ack, body, respond):  # read-only: anyone in an allowed channel
        ack()
        stage = ((body.get("actions") or [{}])[0].get("value")) or "extract"
        ctl = controller_factory()
        try:
            text, blocks = answer(ctl, "logs", [stage], user="")
        finally:
            ctl.close()
        respond(text=text, blocks=blocks, response_type="ephemeral", replace_original=False)


def meaningless(ctl, action_id: str, action: dict) -> str | None:
    """Why a button no longer means anything (None: it still does). A button is checked against what it was
    drawn to do, not against the exact state it was drawn in: "Cancel auto-start" stays valid while auto-start
    can be cancelled, however many steps the handoff took since."""
    if action_id in (ACTION_SNOOZE, ACTION_LATER, ACTION_KEEP, ACTION_ACK):  # about a stage, whatever its run
        return None
    drawn = StateVersion.parse(_version(action))
    now = ctl.state_version()
    if drawn is None or drawn.run != now.run:
        then = (f"belongs to run {drawn.run}" if drawn.run else "was drawn while no run was open") if drawn \
            else "carries no run"
        return f"this message {then}; " + (f"the open run is {now.run}" if now.run else "no run is open now")
    step = now.step or "off"
    if action_id == ACTION_CANCEL and not now.cancellable:
        return f"auto-start can no longer be cancelled (it is {step})"
    if action_id == ACTION_AUTOSTART and now.cancellable:
        return f"auto-start is already armed (it is {step})"
    if action_id == ACTION_AUTOSTART and now.step in (TRAINING, TRAINING_DONE):
        return f"training already ran in this run (auto-start is {step})"
    if action_id == ACTION_TRAIN:
        train = ctl.status(sample_if_unmonitored=False).stages.get("train")
        if train is not None and train.running:
            return "training is already running"
    if action_id == ACTION_CONFIRM and _value(action).get("verb") == "stop":  # a restart starts it either way
        stage = str(_value(action).get("stage"))
        st = ctl.status(sample_if_unmonitored=False).stages.get(stage)
        if st is None or not st.running:
            return f"{stage} is not running any more"
    return None


def _value(action: dict) -> dict:
    """A button's JSON value as a dict ({} for anything else)."""
    try:
        v = json.loads(action.get("value") or "{}")
    except (TypeError, ValueError):
        return {}
    return v if isinstance(v, dict) else {}


def _version(action: dict) -> str | None:
    return _value(action).get("v")


def _describe(action: dict) -> str:
    v = _value(action)
    return f"{v.get('verb', '?')} {v.get('stage', '?')}"


def _stop_later(controller_factory, action: dict, user: str, respond) -> None:
    v = _value(action)
    ctl = controller_factory()
    try:
        if v.get("verb") == "restart":
            stopped, proc = ctl.restart(str(v.get("stage")), by=f"slack:{user}")
            result = stop_text(stopped) + f"; started again ({proc.who})"
        else:
            result = stop_text(ctl.stop(str(v.get("stage")), by=f"slack:{user}"))
    except Exception as exc:  # noqa: BLE001 - reported in Slack as one line
        result = f"{_describe(action)} failed: {exc}"
    finally:
        ctl.close()
    respond(text=f"<@{user}> confirmed *{_describe(action)}* on `{socket.gethostname()}`: {result}",
            response_type="in_channel",
            replace_original=False)  # the channel learns what was done, and by whom


def _act(ctl, action_id: str, action: dict, user: str) -> str:
    if action_id == ACTION_KEEP:
        return f"left as it is ({_describe(action)} not done)"
    if action_id == ACTION_ACK:
        ctl.acknowledge(action.get("value") or "extract", by=f"slack:{user}")
        return f"{action.get('value')}'s alert taken by <@{user}>; it will not be escalated"
    if action_id == ACTION_SNOOZE:
        until = ctl.snooze(action.get("value") or "extract", by=f"slack:{user}")
        return f"alerts about {action.get('value')} snoozed until {slack_time(until)}"
    if action_id == ACTION_LATER:
        r = ctl.remind("eta" if ctl.running_eta() else "1h", by=f"slack:{user}")
        return f"reminder at {slack_time(r['due_at'])}"
    return autostart_text(ctl.autostart(action_id == ACTION_AUTOSTART, by=f"slack:{user}"), cmd=SLASH)
