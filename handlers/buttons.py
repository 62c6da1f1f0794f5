"""Buttons: auto-start, cancel, check back later. A stale button changes nothing."""

from __future__ import annotations

import json
import time

from handlers.auth import refusal
from handlers.blocks import ACTION_AUTOSTART, ACTION_CANCEL, ACTION_LATER, decision_blocks
from handlers.views import autostart_text

LABELS = {ACTION_AUTOSTART: "Auto-start training", ACTION_CANCEL: "Cancel auto-start", ACTION_LATER: "Check back later"}


def register(app, *, controller_factory, ws) -> None:
    """Attach the button listeners."""

    def handle(ack, body, client, respond):
        ack()
        action = (body.get("actions") or [{}])[0]
        action_id = action.get("action_id", "")
        user = (body.get("user") or {}).get("id", "?")
        channel = (body.get("channel") or {}).get("id")
        ctl = controller_factory()
        try:
            why = refusal(ws.config.slack, user=user, channel=channel, mutating=True)
            if why is None and _version(action) != ctl.state_version():
                why = "this message is out of date (the run or auto-start changed since); run `/eagle3 status` again"
                outcome = "stale"
            else:
                outcome = "refused"
            if why:
                ctl.store.audit(user=f"slack:{user}", channel=channel, action=LABELS.get(action_id, action_id),
                                outcome=outcome, detail=why)
                return respond(text=why, response_type="ephemeral", replace_original=False)
            result = _act(ctl, action_id, user)
            ctl.store.audit(user=f"slack:{user}", channel=channel, action=LABELS[action_id], outcome="done",
                            detail=result)
        finally:
            ctl.close()
        text = f"<@{user}> chose *{LABELS[action_id]}* at {time.strftime('%H:%M')}: {result}"
        container = body.get("container") or {}
        if container.get("is_ephemeral") or not container.get("message_ts"):
            respond(text=text, blocks=decision_blocks(text), replace_original=True)
        else:
            client.chat_update(channel=channel, ts=container["message_ts"], text=text, blocks=decision_blocks(text))

    for action_id in LABELS:
        app.action(action_id)(handle)


def _version(action: dict) -> str | None:
    try:
        return json.loads(action.get("value") or "{}").get("v")
    except ValueError:
        return None


def _act(ctl, action_id: str, user: str) -> str:
    if action_id == ACTION_LATER:
        r = ctl.remind("eta" if (ctl.store.get("verdict:extract") or {}).get("eta_s") else "1h", by=f"slack:{user}")
        return f"reminder at {time.strftime('%H:%M', time.localtime(r['due_at']))}"
    on = action_id == ACTION_AUTOSTART
    return autostart_text(on, ctl.autostart(on, by=f"slack:{user}"))
