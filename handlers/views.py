"""Text renderings for the terminal and the console transport (all user-facing wording)."""

from __future__ import annotations

import time


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


def stage_line(name: str, st: dict) -> str:
    """One stage of `eagle3 status` as a line."""
    state = st["state"]
    parts = [f"{name:<8} {state:<11}"]
    if st.get("pid"):
        parts.append(f"pid {st['pid']}")
    if state == "running":
        parts.append(f"up {ago(st.get('uptime_s'))}")
    elif st.get("ended_at"):
        how = f"exit {st['exit_code']}" if st.get("exit_code") is not None else (
            f"signal {st['signal']}" if st.get("signal") else "exit status unknown")
        parts.append(f"{how} at {clock_time(st['ended_at'])}")
    if st.get("reason") and not st["reason"].startswith(("exit code", "killed by signal")):
        parts.append(f"({st['reason']})")
    return "  ".join(parts)


def status_text(status: dict) -> str:
    """The whole `eagle3 status` text."""
    lines = [f"run: {status['run'] or 'none open'}"]
    if status.get("autostart", "off") != "off":
        lines.append(f"auto-start: {status['autostart']} — {status.get('autostart_reason')}")
    if status.get("monitor") == "not running":
        lines.append("monitor: not running (start `eagle3 serve`); running stages were sampled just now")
    box = status.get("outbox") or {}
    if box.get("pending") or box.get("failed"):
        lines.append(f"slack: {box['pending']} message(s) waiting to be delivered, {box['failed']} refused by Slack"
                     + (f" (last error: {box['last_error']})" if box.get("last_error") else ""))
    for name, st in status["stages"].items():
        lines.append(stage_line(name, st))
        if st["state"] != "not-started" and st.get("verdict"):
            lines.append(verdict_line(name, st))
        lines.append(f"{'':<8} log: {st['log']}")
    return "\n".join(lines)


def stop_text(result) -> str:
    """One line per stopped stage, naming any survivors."""
    if not result.was_running:
        return f"{result.stage}: not running"
    how = "stopped (SIGKILL needed after the grace period)" if result.escalated else "stopped"
    if result.note:
        how += f"; {result.note}"
    if result.survivors:
        who = ", ".join(f"{m.pid} ({m.name})" for m in result.survivors)
        return f"{result.stage}: {how}, but these processes of its group survived: {who}"
    return f"{result.stage}: {how}"


def verdict_line(stage: str, st: dict) -> str:
    """The diagnosis part of a stage in `eagle3 status`."""
    verdict = st.get("verdict")
    if not verdict:
        return ""
    parts = [f"{'':<8} verdict: {verdict}"]
    if st.get("progress_pct") is not None:
        done = st.get("done")
        total = st.get("total")
        count = f" ({done + (st.get('failed') or 0):,} / {total:,})" if done is not None and total else ""
        parts.append(f"{st['progress_pct']:.1f} %{count}")
    if st.get("eta_s") is not None:
        parts.append(f"ETA {ago(st['eta_s'])} ({ago(st.get('eta_low_s'))}–{ago(st.get('eta_high_s'))})")
    elif verdict in ("progressing", "slow", "starting"):
        parts.append("ETA not yet meaningful")
    line = ", ".join(parts)
    reasons = st.get("reasons") or []
    return line + ("\n" + "\n".join(f"{'':<10} - {r}" for r in reasons) if reasons else "")


def replay_timeline_line(v) -> str:
    """One verdict change in the readable replay timeline."""
    pct = f" {v.progress_pct:.1f} %" if v.progress_pct is not None else ""
    eta = f" ETA {ago(v.eta_s)}" if v.eta_s is not None else ""
    reasons = f" — {'; '.join(v.reasons)}" if v.reasons else ""
    return f"{clock_time(v.t)}  {v.stage:<8} {v.verdict:<11}{pct}{eta}{reasons}"


def train_guard_text(c) -> str:
    """The train-now refusal, with the manifest's numbers (the incident's 'seems done' at 49 %)."""
    if c.total:
        done = (c.done or 0) + (c.failed or 0)
        head = f"extraction is {c.pct:.1f} % done ({done:,} / {c.total:,})"
        if c.eta_s:
            head += f", about {ago(c.eta_s)} to go"
        if done < c.total:
            head += f"; starting training now would train on {c.pct:.0f} % of the data while the server holds the GPUs"
    else:
        head = "extraction is 0 % done (no manifest totals yet)"
    return (f"refusing to start training: {head}. Not complete because: {'; '.join(c.missing)}. "
            "Run `eagle3 autostart on` to start training by itself once extraction is verified complete, "
            "or `eagle3 start train --force` to override (audited).")


def autostart_text(on: bool, result: dict) -> str:
    """What `eagle3 autostart on|off` says."""
    state = result["state"] or {}
    if on:
        text = (f"auto-start armed: {state.get('reason')}" if result["changed"]
                else f"auto-start already armed (step: {state.get('step')}); nothing changed")
    elif result["changed"]:
        text = "auto-start cancelled"
    elif state.get("step") in ("launching-training", "training-running"):
        text = "auto-start can no longer be cancelled: training was launched; stop it with `eagle3 stop train`"
    else:
        text = "auto-start was not armed; nothing changed"
    if not result["monitor_running"] and on:
        text += ". No monitor is running: it advances only inside `eagle3 serve` — start it."
    return text
