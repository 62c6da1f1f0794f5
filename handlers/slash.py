"""`/eagle3 …`: acknowledged at once, one controller verb, a view. No probe runs here."""

from __future__ import annotations

import difflib

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


def register(app, *, controller_factory, ws) -> None:
    """Attach the /eagle3 listener."""

    @app.command("/eagle3")
    def eagle3(ack, command, respond):
        verb, args = parse(command.get("text", ""))
        user, channel = command.get("user_id", "?"), command.get("channel_id")
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
                ctl.audit(user=f"slack:{user}", channel=channel, action=verb, outcome="done", detail=text[:200])
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
    """(fallback text, blocks) for one verb."""
    status = ctl.status(sample_if_unmonitored=False)
    if verb == "status":
        return status_blocks(status, version=status.version)
    if verb in ("stuck", "eta"):
        started = status.started()
        lines = ([eta_line(n, st, slack=True) + run_label(st, status.run) for n, st in started.items()]
                 if verb == "eta" else
                 [f"*{n}*{run_label(st, status.run)}: {st.state}\n{verdict_line(n, st, slack=True)}"
                  for n, st in started.items()])
        text = "\n".join(lines) or "Nothing has been started."
        return text, text_blocks(text)
    if verb == "gpus":
        gpus = status.first_gpus()
        text = gpus_text(gpus, why=None if gpus else status.gpus_gap())
        return text, text_blocks(f"```\n{text}\n```" if gpus else text)
    if verb == "chart":
        busy = [n for n, st in status.stages.items() if st.running and n != "server"]
        stage = args[0] if args else (busy[-1] if busy else "extract")
        if stage not in STAGE_NAMES:
            return _name_a_stage(verb)
        r = ctl.request_chart(stage, by=f"slack:{user}")
        text = (f"Drawing the {stage} chart: it will appear in the run's thread in a few seconds."
                if r["monitor_running"] else
                f"The {stage} chart will be posted when `eagle3 serve` runs again (it is not running).")
        return text, text_blocks(text)
    if verb == "logs":
        stage = args[0] if args else "extract"
        if stage not in STAGE_NAMES:
            return _name_a_stage(verb)
        _, lines = ctl.logs(stage, lines=30)
        body = redact("\n".join(lines), patterns=ctl.ws.config.slack.redact_patterns)[-2800:] or "(no output yet)"
        return f"last lines of {stage}", text_blocks(f"*{stage}* log:\n```{body}```")
    if verb == "train":
        try:
            proc = ctl.start("train", by=f"slack:{user}")
        except (TrainGuardError, ServerHoldsGpusError) as exc:
            text = (train_guard_text(exc.completion, cmd=SLASH) if isinstance(exc, TrainGuardError)
                    else server_holds_gpus_text(exc, cmd=SLASH))
            _, blocks = status_blocks(status, version=ctl.state_version())
            return text, text_blocks(text) + blocks[-1:]
        text = f"training started ({ctl.owner(proc)})" + (
            f"; no run was open: it trains on run {proc.reopened}'s verified extraction (reopened)"
            if proc.reopened else "")
        return text, text_blocks(text)
    if verb.startswith("autostart"):
        on = verb.endswith("on")
        text = autostart_text(on, ctl.autostart(on, by=f"slack:{user}"), cmd=SLASH)
        return text, text_blocks(text)
    if verb in ("stop", "restart"):
        stage = args[0] if args else ""
        if stage not in STAGE_NAMES:
            return _name_a_stage(verb)
        st = status.stages.get(stage)
        running = bool(st and st.maybe_alive)
        if not running and verb == "stop":
            text = f"*{stage}* is not running ({st.state if st else 'not configured'}); there is nothing to stop."
            return text, text_blocks(text)
        text = (f"{verb.capitalize()} *{stage}*? Its whole process group gets SIGTERM, then SIGKILL after the grace "
                "period." if running else f"Start *{stage}* again? It is {st.state if st else 'not started'} now.")
        return text, text_blocks(text) + confirm_blocks(verb, stage, ctl.state_version(), running=running)
    if verb == "later":
        r = ctl.remind(args[0] if args else "1h", by=f"slack:{user}")
        text = f"I'll post the status again in {ago(r['due_at'] - r['created_at'])}."
        return text, text_blocks(text)
    if args:  # a word that is not a command: say so, with the nearest command, and the short help
        near = difflib.get_close_matches(args[0], sorted({u.split()[0] for u in SUBCOMMANDS}), n=1, cutoff=0.6)
        text = (f"unknown command `{args[0]}`" + (f" — did you mean `{near[0]}`?" if near else "") + "\n" + HELP)
        return text, text_blocks(text)
    return HELP, text_blocks(HELP)
