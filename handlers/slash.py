"""`/eagle3 …`: acknowledged at once, one controller verb, a view. No probe runs here."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from handlers.auth import COMMAND, TRAIL
from handlers.render.blocks import confirm_blocks, status_blocks, text_blocks, train_blocks
from handlers.render.redact import redact
from handlers.render.views import (
    SLASH,
    ago,
    autostart_text,
    eta_line,
    gpus_text,
    run_label,
    server_holds_gpus_text,
    train_guard_text,
    verdict_line,
)
from handlers.verbs import HELP, MUTATING, SUBCOMMANDS, parse
from pipeline.config import STAGE_NAMES
from pipeline.controller import ServerHoldsGpusError, TrainGuardError
from pipeline.errors import UserError
from pipeline.status import RunStatus


def register(app, *, controller_factory, ws) -> None:
    """Attach the /eagle3 listener."""

    @app.command("/eagle3")
    def eagle3(ack, command, respond, context):
        verb, args = context.get(COMMAND) or parse(command.get("text", ""))  # the middleware's parse
        user = command.get("user_id", "?")
        ctl = controller_factory()  # who may ask this was checked by the app's middleware (handlers/auth.guard)
        try:
            if verb == "train" and not ctl.training_running() and ctl.extraction_looks_complete():
                # asked to confirm with Slack's dialog; verification (too slow for Slack's 3 s) runs after the click
                text = "extraction looks complete. Start training? (its sample files are verified first)"
                return ack(text=text, blocks=train_blocks(text, ctl.state_version()))
            try:
                text, blocks = answer(ctl, verb, args, user=user)
            except UserError as exc:
                text, blocks = str(exc), text_blocks(str(exc))
            if verb in MUTATING:
                context[TRAIL].record(ctl, "done", text[:200])
            ack(text=text, blocks=blocks)
        finally:
            ctl.close()
        if verb in ("autostart on", "autostart off") or (verb == "train" and text.startswith("training started")):
            # the channel learns who armed, cancelled or started what (the ack above is the asker's alone)
            respond(text=f"<@{user}> `/eagle3 {verb}`: {text}", response_type="in_channel", replace_original=False)


def train_later(controller_factory, user: str, respond) -> None:
    """Verify, then start training (after a button's ack); the outcome and its actor go to the channel."""
    ctl = controller_factory()
    try:
        text, _ = answer(ctl, "train", [], user=user)
    except Exception as exc:  # noqa: BLE001 - reported in Slack as one line
        text = f"training did not start: {exc}"
    finally:
        ctl.close()
    respond(text=f"<@{user}> `/eagle3 train`: {text}", response_type="in_channel", replace_original=False)


def _name_a_stage(verb: str) -> tuple[str, list]:
    text = f"`/eagle3 {verb} STAGE`: name server, extract or train"
    return text, text_blocks(text)


def answer(ctl, verb: str, args: list[str], *, user: str) -> tuple[str, list]:
    """(fallback text, blocks) for one verb: its entry in VERBS, given the status read once."""
    status = ctl.status(sample_if_unmonitored=False)
    key = "autostart" if verb.startswith("autostart") else verb
    return VERBS.get(key, _help)(Ask(ctl, verb, args, user, status))


@dataclass
class Ask:
    """One slash command as its verb's answer needs it."""

    ctl: Any
    verb: str
    args: list[str]
    user: str
    status: RunStatus

    @property
    def by(self) -> str:
        return f"slack:{self.user}"


def _status(a: Ask) -> tuple[str, list]:
    return status_blocks(a.status, version=a.status.version)


def _stuck_or_eta(a: Ask) -> tuple[str, list]:
    started, run = a.status.started(), a.status.run
    lines = ([eta_line(n, st, slack=True) + run_label(st, run) for n, st in started.items()] if a.verb == "eta" else
             [f"*{n}*{run_label(st, run)}: {st.state}\n{verdict_line(n, st, slack=True)}" for n, st in started.items()])
    text = "\n".join(lines) or "Nothing has been started."
    return text, text_blocks(text)


def _gpus(a: Ask) -> tuple[str, list]:
    gpus = a.status.first_gpus()
    text = gpus_text(gpus, why=None if gpus else a.status.gpus_gap())
    return text, text_blocks(f"```\n{text}\n```" if gpus else text)


def _chart(a: Ask) -> tuple[str, list]:
    busy = [n for n, st in a.status.stages.items() if st.running and n != "server"]
    stage = a.args[0] if a.args else (busy[-1] if busy else "extract")
    if stage not in STAGE_NAMES:
        return _name_a_stage(a.verb)
    r = a.ctl.request_chart(stage, by=a.by)
    text = (f"Drawing the {stage} chart: it will appear in the run's thread in a few seconds." if r["monitor_running"]
            else f"The {stage} chart will be posted when `eagle3 serve` runs again (it is not running).")
    return text, text_blocks(text)


def _logs(a: Ask) -> tuple[str, list]:
    stage = a.args[0] if a.args else "extract"
    if stage not in STAGE_NAMES:
        return _name_a_stage(a.verb)
    _, lines = a.ctl.logs(stage, lines=30)
    body = redact("\n".join(lines), patterns=a.ctl.ws.config.slack.redact_patterns)[-2800:] or "(no output yet)"
    return f"last lines of {stage}", text_blocks(f"*{stage}* log:\n```{body}```")


def _train(a: Ask) -> tuple[str, list]:
    try:
        proc = a.ctl.start("train", by=a.by)
    except (TrainGuardError, ServerHoldsGpusError) as exc:
        text = (train_guard_text(exc.completion, cmd=SLASH) if isinstance(exc, TrainGuardError)
                else server_holds_gpus_text(exc, cmd=SLASH))
        _, blocks = status_blocks(a.status, version=a.ctl.state_version())
        return text, text_blocks(text) + blocks[-1:]
    text = f"training started ({a.ctl.owner(proc)})" + (
        f"; no run was open: it trains on run {proc.reopened}'s verified extraction (reopened)" if proc.reopened else "")
    return text, text_blocks(text)


def _autostart(a: Ask) -> tuple[str, list]:
    on = a.verb.endswith("on")
    text = autostart_text(a.ctl.autostart(on, by=a.by), cmd=SLASH)
    return text, text_blocks(text)


def _stop_or_restart(a: Ask) -> tuple[str, list]:
    stage = a.args[0] if a.args else ""
    if stage not in STAGE_NAMES:
        return _name_a_stage(a.verb)
    st = a.status.stages.get(stage)
    running = bool(st and st.maybe_alive)
    if not running and a.verb == "stop":
        text = f"*{stage}* is not running ({st.state if st else 'not configured'}); there is nothing to stop."
        return text, text_blocks(text)
    text = (f"{a.verb.capitalize()} *{stage}*? Its whole process group gets SIGTERM, then SIGKILL after the grace "
            "period." if running else f"Start *{stage}* again? It is {st.state if st else 'not started'} now.")
    return text, text_blocks(text) + confirm_blocks(a.verb, stage, a.ctl.state_version(), running=running)


def _later(a: Ask) -> tuple[str, list]:
    r = a.ctl.remind(a.args[0] if a.args else "1h", by=a.by)
    text = f"I'll post the status again in {ago(r['due_at'] - r['created_at'])}."
    return text, text_blocks(text)


def _help(a: Ask) -> tuple[str, list]:
    if a.args:  # a word that is not a command: say so, with the nearest command, and the short help
        near = difflib.get_close_matches(a.args[0], sorted({u.split()[0] for u in SUBCOMMANDS}), n=1, cutoff=0.6)
        text = f"unknown command `{a.args[0]}`" + (f" — did you mean `{near[0]}`?" if near else "") + "\n" + HELP
        return text, text_blocks(text)
    return HELP, text_blocks(HELP)


# each verb's answer (`autostart on|off` under "autostart"); anything else is the help
VERBS: dict[str, Callable[[Ask], tuple[str, list]]] = {
    "status": _status, "stuck": _stuck_or_eta, "eta": _stuck_or_eta, "gpus": _gpus, "chart": _chart, "logs": _logs,
    "train": _train, "autostart": _autostart, "stop": _stop_or_restart, "restart": _stop_or_restart,
    "later": _later, "help": _help}
