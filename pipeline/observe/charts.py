"""`eagle3 chart STAGE --out FILE.png`: a stage's run drawn from its observations (matplotlib, Agg).

- extraction (or any sample-counting stage): samples done and failed over time, the ETA band
  projected forward from the last observation, the rate (samples/s, tokens/s), and markers where
  the verdict turned slow, stalled or dead and where the stage was restarted;
- training: loss and kl per step, tokens/s, and the last validation's accuracy by depth;
- GPUs, under either: utilisation and power per GPU on the same time axis, with the stage that
  held them.

1200×720 px: readable at Slack's preview size. Times are UTC, said on the axis.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

WIDTH_PX, HEIGHT_PX, DPI = 1200, 720, 100
MARKED = {"slow": "#d08c00", "stalled": "#c0392b", "dead": "#7f0000"}


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def render(observations: list[dict], *, stage: str, out: Path, events: list[dict] = (), title: str | None = None) -> Path:
    """Draw `observations` (one stage, time order) into a PNG at `out`; returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    from pipeline.observe.diagnosis import Diagnoser

    obs = [o for o in observations if isinstance(o.get("t"), (int, float))]
    gpus = any(o.get("gpus") for o in obs)
    fig, axes = plt.subplots(3 if gpus else 2, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI,
                             sharex=stage != "train", squeeze=False)
    axes = [a[0] for a in axes]
    fig.suptitle(title or f"eagle3 — {stage}", fontsize=12)
    if not obs:
        axes[0].text(0.5, 0.5, "no observations yet", ha="center", va="center", transform=axes[0].transAxes)
    elif stage == "train":
        _training(axes[0], axes[1], obs)
    else:
        d = Diagnoser(stage=stage)
        verdicts = [d.feed(o) for o in obs]
        _progress(axes[0], obs, verdicts, events)
        _rate(axes[1], obs)
    if gpus:
        _gpus(axes[-1], obs)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
    for ax in axes[1 if stage == "train" else 0:]:
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
    axes[-1].set_xlabel("time (UTC)")
    fig.tight_layout()
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
    events = [e for e in store.events() if e.get("stage") == stage and (not run or e.get("run_id") == run)
              and (since is None or e["t"] >= since)]
    return render(obs, stage=stage, out=out, events=events,
                  title=title or f"eagle3 — {stage}" + (f", run {run}" if run else "")), len(obs), run


def _progress(ax, obs: list[dict], verdicts: list, events) -> None:
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
    last = verdicts[-1]
    if total:
        ax.axhline(total, color="grey", lw=0.8, ls=":", label=f"total {total:,}")
    if last.eta_s is not None and total:
        t_end = obs[-1]["t"]
        done = pts[-1][1]["done"] + (pts[-1][1].get("failed") or 0)
        ax.plot([_utc(t_end), _utc(t_end + last.eta_s)], [done, total], color="#1f77b4", ls="--",
                label="projected (ETA)")
        ax.axvspan(_utc(t_end + last.eta_low_s), _utc(t_end + last.eta_high_s), color="#1f77b4", alpha=0.12,
                   label="ETA band")
    for prev, v in zip(verdicts, verdicts[1:], strict=False):
        if v.verdict != prev.verdict and v.verdict in MARKED:
            ax.axvline(_utc(v.t), color=MARKED[v.verdict], lw=1.2)
            ax.annotate(v.verdict, (_utc(v.t), ax.get_ylim()[1]), fontsize=8, color=MARKED[v.verdict],
                        rotation=90, va="top", ha="right")
    for e in events or ():
        if e.get("kind") == "stage-restart" and isinstance(e.get("t"), (int, float)):
            ax.axvline(_utc(e["t"]), color="#555555", lw=1.0, ls="-.")
            ax.annotate("restart", (_utc(e["t"]), 0), fontsize=8, rotation=90, va="bottom", ha="right")
    ax.set_ylabel(unit)


def _rate(ax, obs: list[dict]) -> None:
    pts = [(o["t"], o["progress"]) for o in obs if isinstance(o.get("progress"), dict)
           and isinstance(o["progress"].get("done"), (int, float))]
    rows = []
    for (t0, p0), (t1, p1) in zip(pts, pts[1:], strict=False):
        if t1 > t0:
            n = (p1["done"] + (p1.get("failed") or 0)) - (p0["done"] + (p0.get("failed") or 0))
            k = (p1.get("tokens_done") or 0) - (p0.get("tokens_done") or 0)
            rows.append((_utc(t1), n / (t1 - t0), k / (t1 - t0) if p1.get("tokens_done") is not None else None))
    if not rows:
        return
    ax.plot([r[0] for r in rows], [r[1] for r in rows], color="#2ca02c", lw=0.8, label="samples/s")
    ax.set_ylabel("samples/s")
    if any(r[2] is not None for r in rows):
        tw = ax.twinx()
        tw.plot([r[0] for r in rows], [r[2] or 0 for r in rows], color="#9467bd", lw=0.8, alpha=0.7)
        tw.set_ylabel("tokens/s", color="#9467bd")


def _training(ax, ax2, obs: list[dict]) -> None:
    rows = [o["progress"] for o in obs if isinstance(o.get("progress"), dict)
            and isinstance(o["progress"].get("done"), (int, float))]
    steps = [p["done"] for p in rows]
    for key, color in (("loss", "#1f77b4"), ("kl", "#ff7f0e")):
        vals = [(s, p[key]) for s, p in zip(steps, rows, strict=True) if isinstance(p.get(key), (int, float))]
        if vals:
            ax.plot([v[0] for v in vals], [v[1] for v in vals], color=color, label=key)
    acc = next((p["acc_by_depth"] for p in reversed(rows) if p.get("acc_by_depth")), None)
    if acc:
        text = "top-1 by depth: " + " ".join("-" if a is None else f"{a:.2f}" for a in acc)
        ax.text(0.99, 0.95, text, ha="right", va="top", fontsize=9, transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss / kl (nats)")
    tok = [(_utc(o["t"]), o["progress"].get("tokens_per_s")) for o in obs if isinstance(o.get("progress"), dict)
           and isinstance(o["progress"].get("tokens_per_s"), (int, float))]
    if tok:
        ax2.plot([t for t, _ in tok], [v for _, v in tok], color="#9467bd", lw=0.8, label="tokens/s")
    ax2.set_ylabel("tokens/s")


def _gpus(ax, obs: list[dict]) -> None:
    series: dict[int, list] = {}
    holders: dict[int, set] = {}
    for o in obs:
        for g in o.get("gpus") or []:
            i = g.get("index")
            if isinstance(i, int):
                series.setdefault(i, []).append((_utc(o["t"]), g.get("util"), g.get("power_w")))
                holders.setdefault(i, set()).update(g.get("holders") or [])
    tw = ax.twinx()
    for i, rows in sorted(series.items()):
        held = f" ({', '.join(sorted(holders[i]))})" if holders.get(i) else ""
        ax.plot([r[0] for r in rows], [r[1] if r[1] is not None else float("nan") for r in rows], lw=0.8,
                label=f"GPU {i}{held}")
        tw.plot([r[0] for r in rows], [r[2] if r[2] is not None else float("nan") for r in rows], lw=0.6, ls=":",
                alpha=0.7)
    ax.set_ylabel("utilisation %")
    ax.set_ylim(-5, 105)
    tw.set_ylabel("power W (dotted)")
