"""What each event becomes in Slack: alerts, recoveries, handoff steps, milestones, reminders."""

from __future__ import annotations

import re
from collections.abc import Sequence

from handlers.render.redact import redact
from handlers.render.views import ago, slack_time
from pipeline.states import TRAINING_DONE, TRAINING_FAILED
from pipeline.verdict import StoredVerdict, Verdict

ACTION_LOGS, ACTION_SNOOZE, ACTION_ACK = "eagle3_show_logs", "eagle3_snooze", "eagle3_ack"
ACTION_STACKS = "eagle3_show_stacks"


def mention(user_ids: list[str]) -> str:
    """@-mentions of the on-call users."""
    return " ".join(f"<@{u}>" for u in user_ids)


ENDINGS = (TRAINING_DONE, TRAINING_FAILED)  # handoff steps that end a run: broadcast to the channel


def who_as_mentions(text: str) -> str:
    """"slack:U0123" (how the controller records a Slack user) as a mention, so who did what stays visible."""
    return re.sub(r"\bslack:([UW][A-Z0-9]{2,})\b", r"<@\1>", text)


def event_message(event: dict, *, oncall: list[str], patterns: Sequence[str] = (), host: str = "",
                  took_s: float | None = None) -> tuple[str, str, str | None] | None:
    """`_event_message`, with who did what as mentions."""
    msg = _event_message(event, oncall=oncall, patterns=patterns, host=host, took_s=took_s)
    return None if msg is None else (msg[0], who_as_mentions(msg[1]), msg[2])


def _event_message(event: dict, *, oncall: list[str], patterns: Sequence[str] = (), host: str = "",
                   took_s: float | None = None) -> tuple[str, str, str | None] | None:
    """(kind, text, thread_key) for an event worth posting, else None. thread_key: reply in the run's thread
    (kind "ending": a reply broadcast to the channel too). `host` is named in what reaches the channel;
    `took_s`: how long the stage ran, for its ending. Evidence may quote a stage's log: it is redacted like a
    posted log excerpt."""
    d, kind, stage = event["data"], event["kind"], event.get("stage")
    on = f" on `{host}`" if host else ""
    took = f" after {ago(took_s)}" if took_s else ""
    if kind == "verdict":
        to, frm = Verdict.of(d.get("to")), Verdict.of(d.get("from"))
        evidence = live_ago(redact("\n".join(f"• {r}" for r in d.get("reasons") or []), patterns=patterns),
                            event.get("t"))
        if to and to.stuck:
            return "alert", f":rotating_light: {mention(oncall)} *{stage} is {to}*{on}\n{evidence}", None
        if frm and frm.stuck and to and to.working:
            return "recovery", f":white_check_mark: {stage} recovered{on}: {frm} → {to}\n{evidence}", None
        if to == "done":
            return "ending", f":tada: *{stage} is done*{on}{took}\n{evidence}", "run"
        return None  # a requested stop, a start, progressing ↔ slow: no message
    if kind == "handoff" and d.get("step") in ENDINGS:
        icon = ":tada:" if d["step"] == TRAINING_DONE else ":x:"
        return "ending", f"{icon} auto-start: *{d['step']}*{on}{took} — {d['reason']}", "run"
    if kind == "handoff":
        return "handoff", f"auto-start: *{d['step']}* — {d['reason']}", "run"
    if kind == "chain":
        return "handoff", f"auto-start: *extraction started* — {d['reason']}; the server stays up", "run"
    if kind in ("handoff-alert", "restart-limit", "condition-alert"):
        return "alert", f":rotating_light: {mention(oncall)}{on} {d['reason']}", None
    if kind == "config-changed":
        if d.get("error"):
            return "warning", (f":warning:{on} `{d.get('file')}` was edited and does not load: {d['error']}. serve, "
                               "auto-start and these commands keep the settings it had; fix the file (`eagle3 "
                               "check-config`)."), None
        return "warning", (f":information_source:{on} `{d.get('file')}` was edited: the stages, auto-start, the restart "
                           "policy and these commands use it from now on, as the CLI does ([slack] and [state] "
                           "settings take effect when the service restarts)."), None
    if kind == "transport-warning":
        return "warning", f":warning:{on} {d['reason']}", None
    if kind == "stage-restart":
        return "restart", f"{stage} restarted (attempt {d['attempt']} of {d['limit']}) after: {d['reason']}", "run"
    if kind == "stage-requeued":
        return "restart", requeued_text(stage, d), "run"
    if kind == "reminder":
        stored = {s: StoredVerdict.from_json(v) for s, v in (d.get("status") or {}).items()}
        parts = [f"{s}: {v.verdict}" + (f" {v.progress_pct:.1f} %" if v.progress_pct is not None else "")
                 + (f", about {ago(v.eta_s)} to go" if v.eta_s else "") for s, v in stored.items() if v]
        by = d["by"]
        who = f"<@{by.removeprefix('slack:')}> checking back as asked" if by.startswith("slack:") else \
            f"checking back as asked by {by}"
        return "reminder", f"{who}{on}: " + ("; ".join(parts) or "no stage observed yet"), None
    return None


def requeued_text(stage: str | None, d: dict) -> str:
    """"train reached its 4h time limit at step 12,400; requeued as job 8812 (restart 1 of 3), resumes from
    step 12,400"."""
    done, total, unit = d.get("done"), d.get("total"), d.get("unit") or "done"
    at = "" if not isinstance(done, int) else f" at step {done:,}" if unit == "steps" else \
        f" at {done:,}" + (f" of {total:,}" if isinstance(total, int) else "") + f" {unit}"
    job = (f"requeued as job {d['job_id']}" if d.get("how") == "resubmitted" else
           f"requeued by Slurm (job {d['job_id']})")
    resume = (f", resumes from step {d['resume_step']:,}" if isinstance(d.get("resume_step"), int) else
              ", starts again from its beginning" if stage == "train" else ", resumes where its output stands")
    return f":repeat: {stage} {d['why']}{at}; {job} (restart {d['attempt']} of {d['limit']}){resume}"


_AGO = re.compile(r"\b(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)? ago\b")


def live_ago(text: str, t: float | None) -> str:
    """A reason's "3m12s ago" (as of `t`, when it was judged) as a Slack date token, which stays true as the
    message ages (a frozen "0s ago" in a post read an hour later is wrong). Unchanged without a time."""
    if t is None:
        return text

    def token(m: re.Match) -> str:
        if not any(m.groups()):
            return m.group(0)
        h, mi, s = (int(g or 0) for g in m.groups())
        return slack_time(t - (h * 3600 + mi * 60 + s), "{ago}")
    return _AGO.sub(token, text)


def resolved_text(original: str, after_s: float, *, taken_by: str | None = None) -> str:
    """The alert as it reads once resolved: its headline struck through, for how long it lasted, and who had
    acknowledged it (`taken_by`: "slack:U…" or a CLI user), if anyone."""
    head = original.split("\n", 1)[0]
    taken = f" · {who_as_mentions(taken_by)} was on it" if taken_by else ""
    return f"~{head}~\n:white_check_mark: resolved after {ago(after_s)}{taken} (details in the thread)"


def escalation_text(stage: str, since_s: float, oncall: list[str], host: str = "") -> str:
    """The one reminder when a stage is still stalled."""
    on = f" on `{host}`" if host else ""
    return (f":rotating_light: {mention(oncall)} *{stage} is still stalled*{on} after {ago(since_s)}; "
            "nobody has fixed it yet")


def alert_buttons(stage: str) -> list:
    """Acknowledge / Show logs / Show stacks / Snooze 1 h under an alert."""
    from slack_sdk.models.blocks import ActionsBlock, ButtonElement

    return [ActionsBlock(elements=[
        ButtonElement(text="Acknowledge", action_id=ACTION_ACK, value=stage, style="primary"),
        ButtonElement(text="Show logs", action_id=ACTION_LOGS, value=stage),
        ButtonElement(text="Show stacks", action_id=ACTION_STACKS, value=stage),
        ButtonElement(text="Snooze 1 h", action_id=ACTION_SNOOZE, value=stage)]).to_dict()]


def acknowledged_blocks(blocks: list, user: str, t: float) -> list:
    """An alert's blocks once someone took it: its text as it was, "<@U> is on it since …", and no Acknowledge."""
    kept = []
    for b in blocks or []:
        if b.get("type") == "actions":
            b = {**b, "elements": [e for e in b.get("elements", []) if e.get("action_id") != ACTION_ACK]}
        kept.append(b)
    note = {"type": "context", "elements": [{"type": "mrkdwn", "text": f":eyes: <@{user}> is on it since "
                                                                       f"{slack_time(t)}"}]}
    return [b for b in kept if b.get("type") != "actions"] + [note] + [b for b in kept if b.get("type") == "actions"]


def chart_request_text(stage: str, by: str) -> str:
    """The comment on a chart someone asked for."""
    who = f"<@{by.removeprefix('slack:')}>" if by.startswith("slack:") else by
    return f"{stage}, as {who} asked"


def milestone_text(stage: str, pct: int) -> str:
    """A milestone reply."""
    return f"{stage} passed {pct} %"
