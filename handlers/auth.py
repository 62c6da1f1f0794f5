"""Who may do what through Slack; every decision is audited."""

from __future__ import annotations

from dataclasses import dataclass

from handlers.render.blocks import text_blocks
from handlers.verbs import LABELS, MUTATING, READ_ONLY_ACTIONS, parse


def refusal(slack_cfg, *, user: str, channel: str | None, mutating: bool) -> str | None:
    """Why this user may not act here, or None. Checked before any other reason to refuse."""
    if slack_cfg.allowed_channel_ids and channel not in slack_cfg.allowed_channel_ids:
        return "this channel is not allowed to use eagle3; add it to [slack] allowed_channel_ids in eagle3.toml"
    if not mutating:
        return None
    if not slack_cfg.allowed_user_ids:
        return ("no one may change the pipeline from Slack yet: list the allowed user ids in [slack] "
                "allowed_user_ids in eagle3.toml")
    if user not in slack_cfg.allowed_user_ids:
        return f"<@{user}> is not allowed to change the pipeline; ask an operator to add you to [slack] allowed_user_ids"
    return None



COMMAND = "eagle3_command"  # the request context's key for the parsed slash command (verb, args)
TRAIL = "eagle3_audit"  # the request context's key for its audit trail (`Trail`)


@dataclass(frozen=True)
class Trail:
    """The audit of one Slack request, bound by the middleware: who asked, where, for what. Bolt runs a listener
    after the middleware chain has returned (in its listener pool, after the ack), so only the listener knows how
    the request ended: it hands the outcome back here, and this writes the record — the listener never says
    who or where."""

    user: str
    channel: str | None
    what: str

    def record(self, ctl, outcome: str, detail: str = "", *, what: str | None = None) -> None:
        """Audit this request's `outcome` (done, refused, stale, accepted, confirmed); `what`: a finer name for
        the action than the request's own (a confirmed stop's stage)."""
        ctl.audit(user=f"slack:{self.user}", channel=self.channel, action=what or self.what, outcome=outcome,
                  detail=detail)


def request_facts(body: dict, command: tuple[str, list[str]] | None = None) -> tuple[str, str, str | None, str, bool]:
    """(kind, user, channel, what, mutating) of a Slack request: a slash command (`command`: its parse), a button,
    or an event."""
    if "command" in body:
        verb, _ = command or parse(body.get("text", ""))
        return "command", body.get("user_id", "?"), body.get("channel_id"), verb, verb in MUTATING
    if body.get("type") == "block_actions":
        action = (body.get("actions") or [{}])[0].get("action_id", "?")
        return ("action", (body.get("user") or {}).get("id", "?"), (body.get("channel") or {}).get("id"),
                LABELS.get(action, action), action not in READ_ONLY_ACTIONS)
    event = body.get("event") or {}
    return "event", event.get("user", "?"), event.get("channel"), event.get("type", body.get("type", "?")), False


def guard(ws, controller_factory, executor):
    """Bolt global middleware: one authorization-and-audit step in front of every listener (commands, buttons,
    App Home, and any registered later). A refusal is answered and audited here; the listener never runs.
    `executor`: the app's bounded listener pool, where a refused click's answer goes after the ack."""
    from slack_bolt import BoltResponse

    def middleware(body, ack, respond, context, next):  # noqa: A002 - Bolt injects `next` by name
        if "command" in body:  # parsed once, here: the listener reads it from the request's context
            context[COMMAND] = parse(body.get("text", ""))
        kind, user, channel, what, mutating = request_facts(body, context.get(COMMAND))
        context[TRAIL] = trail = Trail(user=user, channel=channel, what=what)
        # an event (App Home opened) is read-only and comes from the app's own DM, no channel of the allow-list
        why = None if kind == "event" and not mutating else refusal(ws.config.slack, user=user, channel=channel,
                                                                    mutating=mutating)
        if why is None:
            return next()
        ctl = controller_factory()
        try:
            trail.record(ctl, "refused", why)
        finally:
            ctl.close()
        if kind == "command":
            return ack(text=why, blocks=text_blocks(f":no_entry: {why}"))
        if kind == "action":  # answered after the ack, never delaying it (Slack's 3 s)
            executor.submit(respond, text=why, response_type="ephemeral", replace_original=False)
            return ack()
        return BoltResponse(status=200, body="")

    return middleware
