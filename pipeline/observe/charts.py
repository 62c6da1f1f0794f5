"""`eagle3 chart STAGE --out FILE.png`: a stage's run drawn from its observations (matplotlib, Agg).

- extraction (or any sample-counting stage): samples done and failed over time, the ETA band
  projected forward while the stage still runs, the rate (samples/s, and tokens/s on its own
  labelled axis), both from 0, the rate ending at the last unit of a finished stage; each stall or death
  shaded over its no-progress span (from the last progress to the recovery), a dotted line where the stored
  verdict flagged it (the event the alert was sent from, not a recomputation), recoveries, restarts (by the
  policy or by hand) and the handoff;
- training: loss and KL, the learning rate, the simulated acceptance length τ at each validation
  (1 + Σₖ Πⱼ≤ₖ top-1ⱼ), and tokens/s, all over time (the step is in the title);
- GPUs, under either, where a GPU was ever read: utilisation per GPU with the stage that held it, and GPU
  memory (what the handoff waits on before training).

Legends sit above their panels (they cover no line or label); ticks are whole clock times.

Sized for Slack: 960×840 px at 150 dpi, fonts chosen so that text is at least MIN_TEXT_PX tall when
Slack shows the image 480 px wide (tests/unit/pipeline/test_charts.py measures it). Times are UTC, said
on the axis and in the image's alt text (Slack shows each reader's own time zone in messages; an image
cannot).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from pipeline.states import LAUNCHING, STOPPING
from pipeline.verdict import StoredVerdict

WIDTH_PX, HEIGHT_PX, DPI = 960, 840, 150
PREVIEW_PX = 480  # the width Slack previews an image at
MIN_TEXT_PX = 7.0  # the smallest text height (at the preview width) that stays readable
FONT_PT = 9.0
MARKED = {"slow": "#d08c00", "stalled": "#c0392b", "dead": "#7f0000"}
STUCK = ("stalled", "dead")  # verdicts whose no-progress span is shaded
RECOVERED, RESTARTED, HANDOFF = "#2e8b57", "#555555", "#6a3d9a"
HANDOFF_MARKS = {STOPPING: "handoff", LAUNCHING: "training launched"}
RESTART_KINDS = ("stage-restart", "restart-by-hand")
# ConciseDateFormatter's formats by tick level (years, months, days, hours, minutes, seconds)
TICK_FORMATS = ["%Y", "%b", "%d %b", "%H:%M", "%H:%M", "%H:%M:%S"]
TICK_ZERO_FORMATS = ["", "%Y", "%d %b", "%d %b", "%H:%M", "%H:%M"]


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def alt_text(stage: str, run: str | None = None) -> str:
    """What the image shows, for screen readers and Slack's alt text; it names the time zone."""
    what = ("loss, KL, learning rate, simulated acceptance length τ and tokens/s" if stage == "train" else
            "progress, ETA band, rate and verdict changes")
    return f"eagle3 {stage}{f', run {run}' if run else ''}: {what} over time, with GPU use; times in UTC"


def draw(observations: list[dict], *, stage: str, events: Sequence[dict] = (), title: str | None = None,
         verdict: StoredVerdict | None = None):
    """The figure for `observations` (one stage, time order); `events`: the stage's stored events (verdict
    changes, restarts); `verdict`: the stage's stored verdict (its ETA band; None: recomputed from the
    observations, as for a trace file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    obs = [o for o in observations if isinstance(o.get("t"), (int, float))]
    # the GPU panels only where a GPU was ever read (a host without NVML draws no two empty panels)
    gpus = any(isinstance(g, dict) and (g.get("util") is not None or g.get("mem_used_mb") is not None)
               for o in obs for g in o.get("gpus") or [])
    rows = 4 if gpus else 2
    with plt.rc_context({"font.size": FONT_PT, "axes.titlesize": FONT_PT, "axes.labelsize": FONT_PT,
                         "xtick.labelsize": FONT_PT - 1, "ytick.labelsize": FONT_PT - 1,
                         "legend.fontsize": FONT_PT - 1}):
        fig, axes = plt.subplots(rows, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, sharex=True,
                                 squeeze=False)
        panels = [a[0] for a in axes]
        step = next((o["progress"]["done"] for o in reversed(obs) if stage == "train"
                     and isinstance(o.get("progress"), dict) and isinstance(o["progress"].get("done"), (int, float))),
                    None)
        fig.suptitle((title or f"eagle3 — {stage}") + (f" — step {int(step):,}" if step is not None else ""),
                     fontsize=FONT_PT + 1)
        if not obs:
            panels[0].text(0.5, 0.5, "no observations yet", ha="center", va="center", transform=panels[0].transAxes)
        elif stage == "train":
            _training(panels[0], panels[1], obs)
            steps = [(o["t"], o["progress"]) for o in obs if isinstance(o.get("progress"), dict)
                     and isinstance(o["progress"].get("done"), (int, float))]
            if steps:
                _marks(panels[0], steps, events, end=obs[-1]["t"])
        else:
            last = verdict if verdict is not None else _recomputed(obs, stage)
            _progress(panels[0], obs, last, events)
            _rate(panels[1], obs)
        if gpus:
            _gpus(panels[2], panels[3], obs)
        locator = mdates.AutoDateLocator(tz=UTC, minticks=3, maxticks=6)
        # every tick a whole clock time ("18:30", "18:45"; seconds only where the span is that short), never a
        # bare "15" or "30" that reads as a count
        formatter = mdates.ConciseDateFormatter(locator, tz=UTC, formats=TICK_FORMATS, zero_formats=TICK_ZERO_FORMATS,
                                                show_offset=True)
        for ax in panels:
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(locator)
            ax.xaxis.set_major_formatter(formatter)
        panels[-1].set_xlabel("time (UTC)")
        fig.tight_layout()
    return fig


def render(observations: list[dict], *, stage: str, out: Path, events: Sequence[dict] = (), title: str | None = None,
           verdict: StoredVerdict | None = None) -> Path:
    """Draw into a PNG at `out`; returns `out`."""
    import matplotlib.pyplot as plt

    fig = draw(observations, stage=stage, events=events, title=title, verdict=verdict)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def render_run(store, stage: str, *, out: Path, run: str | None = None, since: float | None = None,
               title: str | None = None) -> tuple[Path | None, int, str | None]:
    """Draw one stage of a run (default: the latest) from the store, optionally only since a time.
    Returns (the PNG, or None when there is nothing to draw; how many observations; the run)."""
    run = run or store.latest_run()
    obs = list(store.observations(stage=stage, run=run, since=since))
    if not obs:
        return None, 0, run
    events = [e for e in store.events() if (e.get("stage") == stage or e.get("kind") == "handoff")
              and (not run or e.get("run_id") == run) and (since is None or e["t"] >= since)]
    stored = store.verdict(stage)
    verdict = stored if stored and (not run or stored.run == run) else None  # another run's: recomputed
    return render(obs, stage=stage, out=out, events=events, verdict=verdict,
                  title=title or f"eagle3 — {stage}" + (f", run {run}" if run else "")), len(obs), run


def _recomputed(obs: list[dict], stage: str) -> StoredVerdict:
    from pipeline.observe.diagnosis import Diagnoser

    d = Diagnoser(stage=stage)
    last = None
    for o in obs:
        last = d.feed(o)
    if last is None:
        raise ValueError(f"no observation of {stage} to judge")
    return StoredVerdict.of(last, proc_id=0, run=None, final=last.verdict in ("done", "dead", "stopped"))


def _legend(ax, *others) -> None:
    handles, labels = ax.get_legend_handles_labels()
    for o in others:
        h, lab = o.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:  # above the plot, in a row: it covers no line, peak or marker label
        ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=min(len(handles), 4),
                  frameon=False, borderaxespad=0.2, handlelength=1.5, columnspacing=1.0)


def _progress(ax, obs: list[dict], verdict: StoredVerdict, events) -> None:
    pts = [(o["t"], o["progress"]) for o in obs if isinstance(o.get("progress"), dict)
           and isinstance(o["progress"].get("done"), (int, float))]
    if not pts:
        ax.text(0.5, 0.5, "no progress reading", ha="center", va="center", transform=ax.transAxes)
        return
    ts = [_utc(t) for t, _ in pts]
    unit = pts[-1][1].get("unit") or "samples"
    ax.plot(ts, [p["done"] for _, p in pts], color="#1f77b4", label=f"{unit} done")
    if any(p.get("failed") for _, p in pts):
        ax.plot(ts, [p.get("failed") or 0 for _, p in pts], color="#c0392b", label="failed")
    total = pts[-1][1].get("total")
    if total:
        ax.axhline(total, color="grey", lw=0.8, ls=":", label=f"total {total:,}")
    eta, low, high = verdict.eta_s, verdict.eta_low_s, verdict.eta_high_s
    running = verdict.verdict not in ("done", "dead", "stopped") and not verdict.final
    if running and eta and total:  # a finished stage has nothing to project
        t_end = obs[-1]["t"]
        done = pts[-1][1]["done"] + (pts[-1][1].get("failed") or 0)
        ax.plot([_utc(t_end), _utc(t_end + eta)], [done, total], color="#1f77b4", ls="--", label="projected (ETA)")
        if low is not None and high is not None:
            ax.axvspan(_utc(t_end + low), _utc(t_end + high), color="#1f77b4", alpha=0.12, label="ETA band")
    ax.set_ylim(bottom=0)
    _marks(ax, pts, events, end=obs[-1]["t"])
    ax.set_ylabel(unit)
    _legend(ax)


def _last_progress(pts: list[tuple[float, dict]], t: float) -> float:
    """The time of the last progress (done or failed grew) at or before `t` (the first reading if none)."""
    last, before = pts[0][0], None
    for ti, p in pts:
        if ti > t:
            break
        n = p["done"] + (p.get("failed") or 0)
        if before is not None and n > before:
            last = ti
        before = n
    return last


def _marks(ax, pts: list[tuple[float, dict]], events, *, end: float) -> None:
    """What happened, on the progress panel: each stall or death shaded over its no-progress span (from the last
    progress before it was flagged to its recovery, or to now), a dotted line where the stored verdict flagged it
    (what the alert said, when it said it), recoveries, restarts and the handoff."""
    stuck: dict | None = None  # {verdict, flagged: the flag's time}
    spans, labelled = [], set()
    for e in sorted((e for e in events or () if isinstance(e.get("t"), (int, float))), key=lambda e: e["t"]):
        t, d, kind = e["t"], e.get("data") or {}, e.get("kind")
        if kind == "verdict" and d.get("to") in STUCK and stuck is None:
            stuck = {"verdict": d["to"], "flagged": t}
        elif kind == "verdict" and stuck is not None and d.get("to") not in STUCK:
            spans.append((stuck, t, d.get("to")))
            stuck = None
        elif kind == "verdict" and d.get("to") == "slow":
            ax.axvline(_utc(t), color=MARKED["slow"], lw=0.8, ls=":")
            ax.annotate("slow", (_utc(t), 1.0), xycoords=("data", "axes fraction"), color=MARKED["slow"],
                        rotation=90, va="top", ha="right")
        elif kind in RESTART_KINDS:
            ax.axvline(_utc(t), color=RESTARTED, lw=1.0, ls="-." if kind == "stage-restart" else "--")
            ax.annotate("restart" if kind == "stage-restart" else "manual", (_utc(t), 0.0),
                        xycoords=("data", "axes fraction"), rotation=90, va="bottom", ha="right")
        elif kind == "handoff" and d.get("step") in HANDOFF_MARKS:
            ax.axvline(_utc(t), color=HANDOFF, lw=1.2)
            ax.annotate(HANDOFF_MARKS[d["step"]], (_utc(t), 0.5), xycoords=("data", "axes fraction"), color=HANDOFF,
                        rotation=90, va="center", ha="right")
    if stuck is not None:
        spans.append((stuck, None, None))
    for stuck, until, to in spans:
        colour = MARKED[stuck["verdict"]]
        start = min(_last_progress(pts, stuck["flagged"]), stuck["flagged"])
        label = f"{stuck['verdict']}: no progress" if stuck["verdict"] not in labelled else None
        labelled.add(stuck["verdict"])
        ax.axvspan(_utc(start), _utc(until if until is not None else max(end, stuck["flagged"])), color=colour,
                   alpha=0.15, lw=0, label=label)
        ax.axvline(_utc(stuck["flagged"]), color=colour, lw=1.0, ls=":")
        ax.annotate(stuck["verdict"], (_utc(stuck["flagged"]), 1.0), xycoords=("data", "axes fraction"),
                    color=colour, rotation=90, va="top", ha="right")
        if until is not None and to != "stopped":
            ax.axvline(_utc(until), color=RECOVERED if to != "done" else HANDOFF, lw=1.0)
            ax.annotate("recovered" if to != "done" else "done", (_utc(until), 1.0),
                        xycoords=("data", "axes fraction"), color=RECOVERED, rotation=90, va="top", ha="left")


def _rate(ax, obs: list[dict]) -> None:
    pts = [(o["t"], o["progress"]) for o in obs if isinstance(o.get("progress"), dict)
           and isinstance(o["progress"].get("done"), (int, float))]
    rows = []
    for (t0, p0), (t1, p1) in zip(pts, pts[1:], strict=False):
        if t1 > t0:
            n = (p1["done"] + (p1.get("failed") or 0)) - (p0["done"] + (p0.get("failed") or 0))
            k = (p1.get("tokens_done") or 0) - (p0.get("tokens_done") or 0)
            rows.append((_utc(t1), n / (t1 - t0), k / (t1 - t0) if p1.get("tokens_done") is not None else None))
    total, last = pts[-1][1].get("total") if pts else None, pts[-1][1] if pts else {}
    if total and last.get("done", 0) + (last.get("failed") or 0) >= total:
        while rows and rows[-1][1] == 0:  # finished: the line ends at the last unit, not in a drop to 0
            rows.pop()
    if not rows:
        return
    unit = pts[-1][1].get("unit") or "samples"
    ax.plot([r[0] for r in rows], [r[1] for r in rows], color="#2ca02c", lw=0.8, label=f"{unit}/s")
    ax.set_ylabel(f"{unit}/s", color="#2ca02c")
    ax.set_ylim(bottom=0)
    tw = None
    if any(r[2] is not None for r in rows):
        tw = ax.twinx()
        tw.plot([r[0] for r in rows], [r[2] or 0 for r in rows], color="#9467bd", lw=0.8, alpha=0.8,
                label="tokens/s (right axis)")
        tw.set_ylabel("tokens/s", color="#9467bd")
        tw.set_ylim(bottom=0)
    _legend(ax, *([tw] if tw else []))


def _series(obs: list[dict], key: str) -> list[tuple[datetime, float]]:
    return [(_utc(o["t"]), float(o["progress"][key])) for o in obs if isinstance(o.get("progress"), dict)
            and isinstance(o["progress"].get(key), (int, float))]


def _training(ax, ax2, obs: list[dict]) -> None:
    for key, color in (("loss", "#1f77b4"), ("kl", "#ff7f0e")):
        vals = _series(obs, key)
        if vals:
            ax.plot([v[0] for v in vals], [v[1] for v in vals], color=color, label=key)
    ax.set_ylabel("loss / KL (nats)")
    ax.set_ylim(bottom=0)
    others = []
    tau = _series(obs, "tau")  # the simulated acceptance length at each validation: when to stop
    if tau:
        tw = ax.twinx()
        tw.plot([a[0] for a in tau], [a[1] for a in tau], color="#2ca02c", marker=".", lw=0.8,
                label="τ, simulated (right)")
        tw.set_ylim(1, max(2.0, max(v for _, v in tau) * 1.1))
        tw.set_ylabel("τ (accepted length)", color="#2ca02c")
        others.append(tw)
    _legend(ax, *others)
    tok = _series(obs, "tokens_per_s")
    if tok:
        ax2.plot([t for t, _ in tok], [v for _, v in tok], color="#9467bd", lw=0.8, label="tokens/s")
    ax2.set_ylabel("tokens/s", color="#9467bd")
    ax2.set_ylim(bottom=0)
    lr = _series(obs, "lr")
    tw2 = None
    if lr:
        tw2 = ax2.twinx()
        tw2.plot([t for t, _ in lr], [v for _, v in lr], color="#8c564b", lw=0.8, label="learning rate (right)")
        tw2.set_ylabel("learning rate", color="#8c564b")
        tw2.set_ylim(bottom=0)
    _legend(ax2, *([tw2] if tw2 else []))


def _gpus(ax, mem_ax, obs: list[dict]) -> None:
    series: dict[int, list] = {}
    holders: dict[int, set] = {}
    for o in obs:
        for g in o.get("gpus") or []:
            i = g.get("index")
            if isinstance(i, int):
                series.setdefault(i, []).append((_utc(o["t"]), g.get("util"), g.get("mem_used_mb")))
                holders.setdefault(i, set()).update(g.get("holders") or [])
    nan = float("nan")
    for i, rows in sorted(series.items()):
        held = f" ({', '.join(sorted(holders[i]))})" if holders.get(i) else ""
        line = ax.plot([r[0] for r in rows], [r[1] if r[1] is not None else nan for r in rows], lw=0.8,
                       label=f"{i}{held}")[0]
        mem_ax.plot([r[0] for r in rows], [r[2] / 1024 if r[2] is not None else nan for r in rows], lw=0.8,
                    color=line.get_color())
    ax.set_ylabel("GPU use %")
    ax.set_ylim(-5, 105)
    mem_ax.set_ylabel("GPU memory GiB")
    mem_ax.set_ylim(bottom=0)
    if len(series) <= 8:  # above the panel, as the others: "GPU 0 (extract)"
        ax.legend([f"GPU {line.get_label()}" for line in ax.get_lines()], loc="lower left", bbox_to_anchor=(0.0, 1.0),
                  ncols=min(len(series), 8 if not any(holders.values()) else 4), frameon=False, borderaxespad=0.2,
                  handlelength=1.2, columnspacing=0.8)
