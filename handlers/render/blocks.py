"""Block Kit views (built with slack_sdk's models), within Slack's limits, with fallback text."""

from __future__ import annotations

import json
import socket
import time

from slack_sdk.models.blocks import (
    ActionsBlock,
    Block,
    ButtonElement,
    ConfirmObject,
    ContextBlock,
    MarkdownTextObject,
    SectionBlock,
)

from handlers.render.views import ago, plain_times, run_label, slack_time, tau_text
from pipeline.manifest import mass_line
from pipeline.states import TRAINING, TRAINING_DONE, TRAINING_FAILED, StateVersion
from pipeline.status import RunStatus, StageStatus
from pipeline.train.outdir import accepted_length
from pipeline.verdict import fmt_bytes

SECTION_LIMIT = 3000
ACTION_AUTOSTART, ACTION_CANCEL, ACTION_LATER = "eagle3_autostart_on", "eagle3_autostart_off", "eagle3_later"
ACTION_TRAIN = "eagle3_train"


def bar(pct: float, width: int = 20) -> str:
    """A text progress bar."""
    filled = int(round(width * max(0.0, min(100.0, pct)) / 100))
    return "█" * filled + "░" * (width - filled)


def answer(stage: str, st: StageStatus) -> str:
    """The one-sentence answer to "is it stuck?"."""
    v, pct, eta = st.verdict, st.progress_pct, st.eta_s
    where = f" — {pct:.1f} % done" if pct is not None else ""
    left = f", about {ago(eta)} to go" if eta else ""
    return {
        "progressing": f"Not stuck: {stage} is alive and progressing{where}{left}.",
        "slow": f"Not stuck, but slow: {stage} is progressing below its own earlier rate{where}{left}.",
        "starting": f"Starting: {stage} has not finished its first unit of work yet.",
        "stalled": f"Stuck: {stage} has made no progress past its learned deadline, with no sign of work.",
        "dead": f"Dead: {stage} ended abnormally{where}.",
        "done": f"Done: {stage} finished and its output is complete.",
        "stopped": f"Stopped on request: {stage} is not running, as asked.",
    }.get(str(v)) or _unknown(stage, st)


def _unknown(stage: str, st: StageStatus) -> str:
    """Unknown, with its reason: the verdict's own (an ended stage not yet observed, a reading that failed), or
    the readings' gaps; never "unavailable" with nothing after it."""
    why = "; ".join(st.reasons) or "; ".join(f"{k}: {v}" for k, v in (st.gaps or {}).items())
    if not why and st.ended_at is not None:
        why = f"it ended ({st.reason or st.state}) and its end has not been observed yet"
    return f"Unknown: {stage}'s state cannot be read now" + (f" — {why}." if why else " (no reason recorded).")


def _focus(status: RunStatus) -> tuple[str, StageStatus]:
    """The stage the status post is about: the furthest one running (regeneration too), else the furthest one
    this run started, else the furthest one ever started."""
    stages = status.stages
    order = [n for n in ("train", "extract", "regenerate", "server") if n in stages]
    for name in order:
        if stages[name].running:
            return name, stages[name]
    for name in order:
        if stages[name].started and stages[name].run == status.run:
            return name, stages[name]
    for name in order:
        if stages[name].started:
            return name, stages[name]
    return "extract", stages["extract"]


def _clip(text: str) -> str:
    return text if len(text) <= SECTION_LIMIT else text[: SECTION_LIMIT - 1] + "…"


def _details(name: str, st: StageStatus, now: float) -> list[str]:
    lines = []
    if st.progress_pct is not None and st.total:
        failed = st.failed or 0
        lines.append(f"`{bar(st.progress_pct)}` {st.progress_pct:.1f} % ({st.processed or 0:,} / {st.total:,}), "
                     f"failed {failed:,} ({100 * failed / st.total:.2g} %)")
    rates = []
    prog = st.progress if isinstance(st.progress, dict) else {}
    if name == "train":  # the trainer's own numbers: the loss, how far from the target, its speed
        for key in ("loss", "kl"):
            if isinstance(prog.get(key), (int, float)):
                rates.append(f"{key} {prog[key]:.3f}")
    if name == "train" and isinstance(prog.get("acc_by_depth"), list) and prog["acc_by_depth"]:
        acc = "/".join("-" if a is None else f"{a:.2f}" for a in prog["acc_by_depth"])
        rates.append(f"top-1 by depth {acc} (validation at step {prog.get('validated_at_step')})")
        if tau := tau_text(prog):
            rates.append(tau)
    if st.rate_samples_per_s:
        rates.append(f"{st.rate_samples_per_s:.2f} {'steps' if name == 'train' else 'samples'}/s")
    if st.rate_tokens_per_s:
        rates.append(f"{st.rate_tokens_per_s:,.0f} tokens/s")
    if st.eta_s is not None and st.verdict != "done":  # a finished stage has no time left to show
        when = slack_time(now + st.eta_s, "{time}" if st.eta_s < 12 * 3600 else "{date_short_pretty} {time}")
        rates.append(f"ETA {ago(st.eta_s)} ({ago(st.eta_low_s)}–{ago(st.eta_high_s)}), about {when}")
    if st.last_progress_at:
        rates.append(f"last progress {slack_time(st.last_progress_at, '{ago}')}")  # Slack keeps it current
    if rates:
        lines.append(" · ".join(rates))
    mass = mass_line(prog) if name == "extract" else None
    if mass:
        lines.append(mass)
    gpus = st.gpus or []
    if gpus:
        lines.append(gpu_summary(gpus) + " — idle GPUs alone are not a stall")
    disk = st.disk or {}
    if disk.get("free_bytes") is not None:
        fit = {True: "the run fits", False: "*the run will not fit*", None: "need unknown"}[disk.get("fits")]
        lines.append(f"disk: {fmt_bytes(disk['free_bytes'])} free, {fit}")
    server = st.server or {}
    if server.get("healthy") is not None:
        lines.append(f"server activity (not progress): {'healthy' if server['healthy'] else 'health check failing'}"
                     + (f", {server['running_reqs']:.0f} running" if server.get("running_reqs") is not None else "")
                     + (f", counter {server['requests_total']:,.0f} requests" if server.get("requests_total") else ""))
    return lines


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 6] → '0–3, 6'."""
    out, start = [], None
    for i, j in zip(indices, indices[1:] + [None], strict=True):
        start = i if start is None else start
        if j != i + 1:
            out.append(f"{start}–{i}" if i > start else f"{i}")
            start = None
    return ", ".join(out)


def gpu_summary(gpus: list[dict]) -> str:
    """GPUs alike grouped: 'GPUs 0–7: 97 % busy, 75 GB each (extract)'; a reading NVML did not give is '?'."""
    groups: dict[tuple, list[int]] = {}
    for g in gpus:
        index = g.get("index")
        if not isinstance(index, int):  # every reading the probe makes has one
            continue
        util = "?" if g.get("util") is None else f"{g['util']:.0f} %"
        mem = "?" if g.get("mem_used_mb") is None else f"{g['mem_used_mb'] / 1024:.0f} GB"
        groups.setdefault((util, mem, ", ".join(g.get("holders") or [])), []).append(index)
    parts = []
    for (util, mem, holders), idx in groups.items():
        idx = sorted(i for i in idx if isinstance(i, int))
        name = f"GPU {idx[0]}" if len(idx) == 1 else f"GPUs {_ranges(idx)}"
        parts.append(f"{name}: {util} busy, {mem}{' each' if len(idx) > 1 else ''}"
                     + (f" ({holders})" if holders else ""))
    return " · ".join(parts)


def status_blocks(status: RunStatus, *, version: StateVersion | None, now: float | None = None,
                  note: str | None = None, host: str | None = None) -> tuple[str, list]:
    """(fallback text, blocks) for `/eagle3 status`; `note`: a context line above the buttons
    (who chose what, after a click on the status post); `host`: the pipeline's host (default: this one, where
    the bot runs), so that two hosts in one channel can be told apart."""
    now = now or time.time()
    name, st = _focus(status)
    host = socket.gethostname() if host is None else host
    headline = (f"*Run {status.run or '(none open)'}*" + (f" on `{host}`" if host else "")
                + f" — {name}{run_label(st, status.run)}: *{st.verdict or st.state}*")
    sentence = answer(name, st) if st.started else "Nothing is running yet."
    blocks: list[Block] = [SectionBlock(text=MarkdownTextObject(text=_clip(f"{headline}\n{sentence}")))]
    details = _details(name, st, now)
    if details:
        blocks.append(SectionBlock(text=MarkdownTextObject(text=_clip("\n".join(details)))))
    auto = status.autostart
    blocks.append(ContextBlock(elements=[MarkdownTextObject(text=_clip(
        f"auto-start: {auto}" + (f" — {status.autostart_reason}" if auto != "off" else "")
        + f" · as of {slack_time(now)}"))]))
    if note:
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=_clip(note))]))
    value = json.dumps({"v": str(version)})
    if status.autostart_cancellable:
        buttons = [ButtonElement(text="Cancel auto-start", action_id=ACTION_CANCEL, value=value, style="danger")]
    elif (status.handoff in (TRAINING, TRAINING_DONE, TRAINING_FAILED) or status.run is None
          or (status.stages.get("train") and status.stages["train"].running)):
        buttons = []  # no run to hand off in, or training already ran or runs in it
    else:
        buttons = [ButtonElement(text="Auto-start training when extraction finishes", action_id=ACTION_AUTOSTART,
                                 value=value, style="primary", confirm=confirm(
                                     "Auto-start training?", "When extraction is verified complete, the SGLang "
                                     "server is stopped — for everyone using it — and training starts on its GPUs.",
                                     "Arm auto-start"))]
    buttons.append(ButtonElement(text="Check back later", action_id=ACTION_LATER, value=value))
    blocks.append(ActionsBlock(elements=buttons))
    return f"{name}: {st.verdict or st.state} — {sentence}", [b.to_dict() for b in blocks]


def choice_note(user: str, label: str, t: float, result: str) -> str:
    """Who chose what on the status post, when, and what came of it: the note the post keeps (`user`: "slack:U…"
    as the audit records it, or a bare Slack id)."""
    who = f"<@{user.removeprefix('slack:')}>" if user.startswith("slack:") or user[:1] in "UW" else user
    return f"{who} chose *{label}* at {slack_time(t)}: {result}"


def final_blocks(status: RunStatus, *, run: str, closed: str | None, host: str = "",
                 now: float | None = None) -> tuple[str, list]:
    """The run's status post as it is left once the run closed: how each of its stages ended, how long it ran,
    its samples (or steps) and tokens, training's last loss and top-1 by depth; no buttons."""
    now = now or time.time()
    lines, gpu_hours = [], 0.0
    for name, st in status.stages.items():
        if not st.started or st.run != run:
            continue
        how = st.verdict or st.state
        took = f" after {ago(st.ended_at - st.started_at)}" if st.ended_at and st.started_at else ""
        why = "stopped on request" if st.stop_requested else st.reason  # a SIGTERM asked for is no "killed by"
        parts = [f"*{name}*: {how}{took}" + (f" ({why})" if why and how not in ("done",) else "")]
        prog = st.progress if isinstance(st.progress, dict) else {}
        if st.total:
            unit = prog.get("unit") or "samples"
            parts.append(f"{st.processed or 0:,} / {st.total:,} {unit}" + (f", {st.failed:,} failed" if st.failed else ""))
        if prog.get("tokens_done"):
            parts.append(f"{prog['tokens_done']:,.0f} tokens")
        if prog.get("loss") is not None:
            parts.append(f"final loss {prog['loss']:.4g}")
        acc = [a for a in prog.get("acc_by_depth") or [] if a is not None]
        if acc:
            parts.append("top-1 by depth " + ", ".join(f"{a:.2f}" for a in acc[:8]))
            parts.append((tau_text(prog) or f"τ ≈ {1 + accepted_length(acc):.2f}")
                         + f" (depth {len(acc)}, simulated from validation)")
        if st.gpus and st.ended_at and st.started_at:  # the GPUs the stage held, for as long as it ran
            used = len(st.gpus) * (st.ended_at - st.started_at) / 3600
            gpu_hours += used
            parts.append(f"{len(st.gpus)} GPU{'s' if len(st.gpus) > 1 else ''}, {used:.2f} GPU-h")
        lines.append(" · ".join(parts))
    head = (f"*Run {run}*" + (f" on `{host}`" if host else "") + " — *ended*"
            + (f": {closed}" if closed else "") + (f" · {gpu_hours:.2f} GPU-hours in all" if gpu_hours else ""))
    body = "\n".join(lines) or "No stage ran in this run."
    blocks = [SectionBlock(text=MarkdownTextObject(text=_clip(f"{head}\n{body}"))),
              ContextBlock(elements=[MarkdownTextObject(text=f"final · as of {slack_time(now)}")])]
    return f"run {run} ended" + (f": {closed}" if closed else ""), [b.to_dict() for b in blocks]


def text_blocks(text: str) -> list:
    """Text as one section: answers, event messages, and a message after its button was used."""
    return [SectionBlock(text=MarkdownTextObject(text=_clip(text))).to_dict()]


ACTION_CONFIRM, ACTION_KEEP = "eagle3_confirm", "eagle3_keep"


def confirm(title: str, text: str, yes: str) -> ConfirmObject:
    """Slack's own are-you-sure dialog on a button (Block Kit `confirm`), shown before the click is sent."""
    return ConfirmObject(title=title, text=MarkdownTextObject(text=text), confirm=yes, deny="Cancel", style="danger")


CONSEQUENCES = {"stop": "{stage} is stopped: SIGTERM to its process group, SIGKILL after the grace period.",
                "restart": "{stage} is stopped (SIGTERM, then SIGKILL after the grace period) and started again."}


def confirm_blocks(verb: str, stage: str, version: StateVersion, *, running: bool = True) -> list:
    """Confirm / keep buttons for stop and restart; the confirm button asks Slack's dialog first. A stage that is
    not running is offered no "Keep it running"."""
    value = json.dumps({"v": str(version), "verb": verb, "stage": stage})
    consequence = CONSEQUENCES[verb].format(stage=stage) if running else f"{stage} is started again."
    return [ActionsBlock(elements=[
        ButtonElement(text=f"{verb.capitalize()} {stage}", action_id=ACTION_CONFIRM, value=value, style="danger",
                      confirm=confirm(f"{verb.capitalize()} {stage}?", consequence, f"{verb.capitalize()} {stage}")),
        ButtonElement(text="Keep it running" if running else "Leave it stopped", action_id=ACTION_KEEP,
                      value=value)]).to_dict()]


def blocks_text(blocks: list, fallback: str = "") -> str:
    """A plain-text rendering of Block Kit blocks, as the console transport prints a message."""
    out = []
    for b in blocks or []:
        kind = b.get("type")
        if kind == "section":
            out.append((b.get("text") or {}).get("text", ""))
            out.extend(f.get("text", "") for f in b.get("fields") or [])
        elif kind == "context":
            out.append("  " + " · ".join(e.get("text", "") for e in b.get("elements") or []))
        elif kind == "actions":
            out.append("  " + "  ".join(f"[ {(e.get('text') or {}).get('text', '')} ]" for e in b.get("elements") or []))
        elif kind == "divider":
            out.append("—" * 20)
        elif kind == "header":
            out.append((b.get("text") or {}).get("text", ""))
    return plain_times("\n".join(x for x in out if x) or fallback)


def train_blocks(text: str, version: StateVersion) -> list:
    """`/eagle3 train` on a run whose extraction looks complete: a Start training button behind Slack's
    confirmation (the sample files are verified after the click, then training starts)."""
    button = ButtonElement(text="Start training", action_id=ACTION_TRAIN, value=json.dumps({"v": str(version)}),
                           style="primary", confirm=confirm(
                               "Start training?", "Sample files are verified first; then training starts on its "
                               "GPUs, in this run. The SGLang server must have released them.", "Start training"))
    return text_blocks(text) + [ActionsBlock(elements=[button]).to_dict()]
