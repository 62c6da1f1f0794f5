"""Text renderings for the terminal and the console transport (all user-facing wording)."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.manifest import mass_line
from pipeline.status import AutostartResult, RunStatus, StageStatus
from pipeline.verdict import Verdict, fmt_bytes


def ago(seconds: float | None) -> str:
    """A short human duration such as '4h 48m' or '12s' ('unknown' for None)."""
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, _ = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours < 48 else f"{hours // 24}d {hours % 24}h"


def clock_time(t: float | None) -> str:
    """Local wall-clock time of a unix timestamp."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def slack_time(t: float, token: str = "{time}") -> str:
    """A time Slack renders in each reader's own time zone (`<!date^…>`), with a UTC fallback."""
    fallback = time.strftime("%H:%M UTC" if token in ("{time}", "{ago}") else "%Y-%m-%d %H:%M UTC", time.gmtime(t))
    fallback = f"at {fallback}" if token == "{ago}" else fallback
    return f"<!date^{int(t)}^{token}|{fallback}>"


def plain_times(text: str) -> str:
    """`<!date^…|fallback>` as its fallback, for a terminal."""
    import re

    return re.sub(r"<!date\^\d+\^[^|>]*\|([^>]*)>", r"\1", text)


def gpus_text(gpus: list[dict] | None, *, why: str | None = None) -> str:
    """gpustat-like: one line per GPU — index, name, utilisation, memory, power, temperature, holder.
    A reading NVML did not give is '?', never 0."""
    if not gpus:
        return f"GPUs: no reading{f' ({why})' if why else ' yet'}"
    q = lambda v, fmt: "?" if v is None else format(v, fmt)  # noqa: E731
    lines = []
    for g in gpus:
        holder = ", ".join(g.get("holders") or []) or ("-" if g.get("pids") == [] else "?")
        lines.append(f"[{g.get('index', '?')}] {(g.get('name') or 'GPU'):<22} | {q(g.get('util'), '3.0f'):>3} % | "
                     f"{q(g.get('mem_used_mb'), ',.0f'):>7} / {q(g.get('mem_total_mb'), ',.0f')} MB | "
                     f"{q(g.get('power_w'), '.0f')} / {q(g.get('power_limit_w'), '.0f')} W | "
                     f"{q(g.get('temp_c'), '.0f')} °C | {holder}")
    return "\n".join(lines)


def run_label(st: StageStatus, current: str | None) -> str:
    """' (run r…, closed)' for a stage whose latest process belongs to a run that is not the open one (one run is
    open at a time, so it is closed): its state and readings are that run's, never this run's."""
    return f" (run {st.run}, closed)" if st.started and st.run and st.run != current else ""


def stage_line(name: str, st: StageStatus, current: str | None = None) -> str:
    """One stage of `eagle3 status` as a line."""
    parts = [f"{name:<8} {st.state:<11}" + run_label(st, current)]
    if st.pid:
        parts.append(f"pid {st.pid}")
    if st.job:
        parts.append(f"Slurm job {st.job}" + (f" on {st.nodes}" if st.nodes else "")
                     + (f" (read through {st.read['via']}, {ago(st.read.get('age_s') or 0)} old at its observation)"
                        if st.read else ""))
    if st.running:
        parts.append(f"up {ago(st.uptime_s)}")
    elif st.ended_at:
        how = f"exit {st.exit_code}" if st.exit_code is not None else (
            f"signal {st.signal}" if st.signal else "exit status unknown")
        parts.append(f"{how} at {clock_time(st.ended_at)}")
    if st.reason and not st.reason.startswith(("exit code", "killed by signal")):
        parts.append(f"({st.reason})")
    return "  ".join(parts)


def tau_text(prog: dict | None) -> str | None:
    """"τ ≈ 3.40 at step 2,000 (3.10 at 1,000)", and "; not rising since step 1,500" when it stopped rising: the
    trainer's simulated acceptance length at its last validations (None before the first)."""
    prog = prog if isinstance(prog, dict) else {}
    if not isinstance(prog.get("tau"), (int, float)):
        return None
    def at(step) -> str:
        return f" at step {step:,}" if isinstance(step, int) else ""
    text = f"τ ≈ {prog['tau']:.2f}{at(prog.get('tau_step'))}"
    if isinstance(prog.get("tau_prev"), (int, float)):
        prev = prog.get("tau_prev_step")
        text += f" ({prog['tau_prev']:.2f}" + (f" at {prev:,})" if isinstance(prev, int) else ")")
    if prog.get("tau_flat_since") is not None:
        text += f"; not rising since step {prog['tau_flat_since']:,}"
    return text


def outbox_line(box: dict) -> str:
    """Undelivered Slack messages: those still retried, those Slack refused for good, and the last error."""
    error = box.get("last_error")
    parts = [f"{box['pending']} message(s) waiting to be delivered" if box.get("pending") else None,
             f"{box['failed']} refused by Slack for good" if box.get("failed") else None]
    return ("slack: " + ", ".join(p for p in parts if p)
            + (f" (last error: {error}; {slack_hint(error)})" if error else ""))


def status_text(status: RunStatus) -> str:
    """The whole `eagle3 status` text."""
    lines = [f"run: {status.run or 'none open'}"]
    if status.autostart != "off":
        lines.append(f"auto-start: {status.autostart} — {status.autostart_reason}")
    if status.monitor == "not running":
        lines.append("monitor: not running (start `eagle3 serve`); running stages were sampled just now")
    if status.transport:
        lines.append(transport_line(status.transport))
    auth = status.slack_auth or {}
    if auth.get("ok") is False:
        lines.append(f"slack: the bot token was refused ({auth.get('error')}); {slack_hint(auth.get('error') or '')}")
    changed = status.config_changed
    if changed:
        lines.append(f"config: {Path(changed['file']).name} was edited at {clock_time(changed['t'])} and does not load "
                     f"({changed.get('error')}); serve keeps the settings it had until the file is fixed")
    box = status.outbox
    if box.get("pending") or box.get("failed"):
        lines.append(outbox_line(box))
    for name, st in status.stages.items():
        lines.append(stage_line(name, st, status.run))
        if st.started and st.verdict:
            lines.append(verdict_line(name, st))
        tau = tau_text(st.progress) if name == "train" else None
        if tau:
            lines.append(f"{'':<8} {tau} (simulated from the validation's top-1 by depth; eval-draft measures it)")
        mass = mass_line(st.progress) if name == "extract" and st.run == status.run and st.progress else None
        if mass:
            lines.append(f"{'':<8} {mass}")
        if st.out:
            lines.append(f"{'':<8} out: {st.out}")
        lines.append(f"{'':<8} log: {st.log}")
    return "\n".join(lines)


_TRANSPORTS = {"socket-mode": "Slack Socket Mode", "http": "Slack HTTP events"}


def transport_line(t: dict) -> str:
    """How serve receives commands and buttons, and whether that works right now."""
    kind = str(t.get("kind"))
    name = _TRANSPORTS.get(kind, kind)
    if t.get("state") in ("connected", "listening"):
        return f"commands: {name} {t['state']} since {clock_time(t.get('since'))}"
    text = f"commands: {name} {t.get('state')} since {clock_time(t.get('since'))}"
    if t.get("error"):
        text += f" (last error: {t['error']}; retrying in {t.get('retry_in_s', 0):.0f} s)"
    return text + "; monitoring and auto-start go on meanwhile"


_SLACK_HINTS = {
    "not_in_channel": "invite the bot to the channel (`/invite @eagle3` there); the messages are sent once it is in",
    "channel_not_found": "set [slack] channel to the channel's id (C…); for a private channel, invite the bot first",
    "missing_scope": "add the scope Slack names to the app (OAuth & Permissions, as in deploy/slack-manifest.yaml), "
                     "reinstall it and put the new token in the env file",
    "is_archived": "unarchive the channel, or set [slack] channel to another one",
    "invalid_auth": "SLACK_BOT_TOKEN is not valid: put the bot token (xoxb-…) in the env file, restart serve",
    "not_authed": "SLACK_BOT_TOKEN is empty: put the bot token (xoxb-…) in the env file, restart serve",
    "token_revoked": "the bot token was revoked: reinstall the app, put the new token in the env file, restart serve",
    "account_inactive": "the bot's account is inactive: reinstall the app, put the new token in the env file",
}


def slack_hint(error: str) -> str:
    """What to do about a delivery error (`eagle3 status`)."""
    code = error.split(" ")[0]
    if code in _SLACK_HINTS:
        return _SLACK_HINTS[code]
    if error.startswith("network:"):
        return "Slack cannot be reached from this host: check its network, proxy and DNS; delivery retries by itself"
    return "see the service's log (`journalctl -u eagle3`)"


def stop_text(result) -> str:
    """One line per stopped stage, naming any survivors."""
    if not result.was_running:
        return f"{result.stage}: not running" + (f"; {result.note}" if result.note and result.note != "not running" else "")
    how = "stopped (SIGKILL needed after the grace period)" if result.escalated else "stopped"
    if result.note:
        how += f"; {result.note}"
    if result.survivors:
        who = ", ".join(f"{m.pid} ({m.name})" for m in result.survivors)
        return f"{result.stage}: {how}, but these processes of its group survived: {who}"
    return f"{result.stage}: {how}"


def _progress_text(st: StageStatus) -> str:
    """'49.4 % (18,424 / 37,312)'."""
    count = f" ({st.processed:,} / {st.total:,})" if st.processed is not None and st.total else ""
    return f"{st.progress_pct:.1f} %{count}"


def _band_text(st: StageStatus) -> str:
    """'ETA 4h 48m (4h 10m–5h 30m)'."""
    return f"ETA {ago(st.eta_s)} ({ago(st.eta_low_s)}–{ago(st.eta_high_s)})"


def verdict_line(stage: str, st: StageStatus, *, slack: bool = False) -> str:
    """The diagnosis part of a stage in `eagle3 status` (`slack`: for a message — no terminal indentation, the
    evidence as bullets)."""
    verdict = st.verdict
    if not verdict:
        return ""
    parts = [f"*verdict* {verdict}" if slack else f"{'':<8} verdict: {verdict}"]
    if st.progress_pct is not None:
        parts.append(_progress_text(st))
    if st.eta_s is not None and verdict != Verdict.DONE:  # a finished stage has no time left to show
        parts.append(_band_text(st))
    elif verdict.working:
        parts.append(f"no ETA yet ({st.eta_note})" if st.eta_note else "ETA not yet meaningful")
    prog = st.progress if isinstance(st.progress, dict) else {}
    if (verdict.working or verdict == Verdict.STALLED) and prog.get("max_inflight_bytes"):
        parts.append(f"answers in memory {fmt_bytes(prog.get('inflight_bytes') or 0)} of "
                     f"{fmt_bytes(prog['max_inflight_bytes'])}")
    line = ", ".join(parts)
    bullet = "• " if slack else f"{'':<10} - "
    return line + ("\n" + "\n".join(f"{bullet}{r}" for r in st.reasons) if st.reasons else "")


def eta_line(stage: str, st: StageStatus, *, now: float | None = None, slack: bool = False) -> str:
    """`/eagle3 eta`: progress, the ETA with its band and the wall-clock finish, or why there is none."""
    head = f"*{stage}*: {st.verdict or st.state}"
    if st.progress_pct is not None:
        head += f", {_progress_text(st)}"
    if st.eta_s is not None and st.verdict != Verdict.DONE:
        finish = (now or time.time()) + st.eta_s
        return (f"{head}, {_band_text(st)}, "
                f"finishing around {slack_time(finish, '{date_short_pretty} {time}') if slack else clock_time(finish)}")
    if st.verdict in (Verdict.DONE, Verdict.STOPPED, Verdict.DEAD):
        return head
    why = st.eta_note or "; ".join(st.reasons) or "not enough progress observed yet"
    return f"{head}, no ETA yet ({why})"


def replay_timeline_line(v) -> str:
    """One verdict change in the readable replay timeline."""
    pct = f" {v.progress_pct:.1f} %" if v.progress_pct is not None else ""
    eta = f" ETA {ago(v.eta_s)}" if v.eta_s is not None else ""
    reasons = f" — {'; '.join(v.reasons)}" if v.reasons else ""
    return f"{clock_time(v.t)}  {v.stage:<8} {v.verdict:<11}{pct}{eta}{reasons}"


CLI, SLASH = "eagle3 ", "/eagle3 "  # how a refusal names a command: where the reader is


def train_guard_text(c, *, cmd: str = CLI) -> str:
    """The train-now refusal, with the manifest's numbers (the incident's 'seems done' at 49 %)."""
    if c.total:
        done = (c.done or 0) + (c.failed or 0)
        head = f"extraction is {c.pct:.1f} % done ({done:,} / {c.total:,})"
        if c.eta_s:
            head += f", about {ago(c.eta_s)} to go"
        if done < c.total:
            head += f"; starting training now would train on {c.pct:.0f} % of the data"
            if c.server_running:
                head += " while the server holds the GPUs"
    elif any(m.startswith("waiting for regeneration") for m in c.missing):
        head = "regeneration is still running: extraction has not started"
    elif c.run is None or any(m.startswith(("extraction has not run", "no run is open")) for m in c.missing):
        head = "extraction has not run in this run" if c.run else "no run is open"
    else:
        head = "extraction is 0 % done (no manifest totals yet)"
    then = ("Auto-start is armed: training starts by itself once extraction is verified complete"
            if c.autostart_armed else
            f"Run `{cmd}autostart on` to start training by itself once extraction is verified complete")
    return (f"refusing to start training: {head}. Not complete because: {'; '.join(c.missing)}. "
            f"{then}, or {_force(cmd)} to override (audited).")


def _force(cmd: str) -> str:
    return "`eagle3 start train --force` on the host" if cmd == SLASH else "`eagle3 start train --force`"


def server_holds_gpus_text(exc, *, cmd: str = CLI) -> str:
    """The refusal of training beside a running SGLang server (they would compete for GPU memory)."""
    return (f"refusing to start training: {exc}, which training needs; both would compete for the GPUs' memory. "
            f"Run `{cmd}autostart on` to hand off (stop the server, wait for the GPUs' release, then launch "
            f"training), or `{cmd}stop server` first; {_force(cmd)} overrides (audited).")


def autostart_text(result: AutostartResult, *, cmd: str = CLI) -> str:
    """What `eagle3 autostart on|off` says."""
    state = result.state
    if result.on:
        armed = "auto-start armed for the next run" if state and state.for_next_run and state.run is None \
            else "auto-start armed"
        reason = state.reason if state else None
        text = (f"{armed}: {reason}" if result.changed
                else f"auto-start already armed for this run (step: {state.step if state else 'off'}); nothing changed")
    elif result.changed:
        text = "auto-start cancelled"
    elif result.refused:
        text = f"auto-start can no longer be cancelled: {state.reason if state else ''}; stop it with `{cmd}stop train`"
    else:
        text = "auto-start was not armed; nothing changed"
    if not result.monitor_running and result.on:
        text += ". No monitor is running: it advances only inside `eagle3 serve` — start it."
    return text
