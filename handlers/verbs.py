"""What Slack can ask of eagle3: the slash command's verbs and grammar, and the buttons' names. The listeners
answer them; the middleware (`handlers/auth.py`) reads them to tell a change from a question and to audit
an action by the words the user saw."""

from __future__ import annotations

from handlers.render.alerts import ACTION_ACK, ACTION_LOGS, ACTION_SNOOZE, ACTION_STACKS
from handlers.render.blocks import (
    ACTION_AUTOSTART,
    ACTION_CANCEL,
    ACTION_CONFIRM,
    ACTION_KEEP,
    ACTION_LATER,
    ACTION_TRAIN,
)

SUBCOMMANDS = {  # usage -> what it answers; the help text, the docs test and the app manifest use this
    "status": "the run at a glance: stage, verdict, progress, rate, ETA, GPUs, disk (also `/eagle3` alone)",
    "stuck": "each stage's verdict with its evidence",
    "eta": "each stage's progress and ETA with its band",
    "gpus": "GPU utilization and memory, and which stage holds them",
    "chart [STAGE]": "a chart of the stage (default: the one running) posted in the run's thread",
    "logs STAGE": "the last lines of a stage's log, secrets redacted",
    "train": "start training now (asks to confirm) — refused with the numbers until extraction is verified complete",
    "autostart on|off": "arm or cancel training's automatic start when extraction is verified complete",
    "later 30m|1h|eta": "post the status again after a while, or when the ETA is due",
    "stop STAGE": "stop server, extract or train (asks to confirm)",
    "restart STAGE": "stop and start a stage again (asks to confirm)",
    "help": "this list",
}
HELP = "*/eagle3* commands:\n" + "\n".join(f"• `{usage}` — {what}" for usage, what in SUBCOMMANDS.items())
MAX_TEXT = 200


def parse(text: str) -> tuple[str, list[str]]:
    """(verb, args) of the command text; unknown or over-long text is `help`."""
    words = (text or "").strip().lower().split()
    if len(text or "") > MAX_TEXT or not words:
        return ("status", []) if not words else ("help", [])
    verb, args = words[0], words[1:]
    if verb == "autostart" and args[:1] in (["on"], ["off"]):
        return f"autostart {args[0]}", []
    known = {usage.split()[0] for usage in SUBCOMMANDS} - {"autostart"}
    return (verb, args) if verb in known else ("help", [verb[:40]])


MUTATING = frozenset({"autostart on", "autostart off", "train", "stop", "restart"})  # `later` only reminds
LABELS = {ACTION_AUTOSTART: "Auto-start training", ACTION_CANCEL: "Cancel auto-start", ACTION_LATER: "Check back later",
          ACTION_CONFIRM: "Confirm", ACTION_KEEP: "Keep it running", ACTION_SNOOZE: "Snooze 1 h",
          ACTION_TRAIN: "Start training", ACTION_ACK: "Acknowledge"}

STATUS_ACTIONS = frozenset({ACTION_AUTOSTART, ACTION_CANCEL, ACTION_LATER})  # the status post's buttons

# Buttons anyone in an allowed channel may press: reading, a reminder, "keep it running". Every other action,
# a listener added later included, is mutating until said otherwise: a new button is refused for a stranger.
READ_ONLY_ACTIONS = frozenset({ACTION_LATER, ACTION_LOGS, ACTION_KEEP, ACTION_STACKS})
