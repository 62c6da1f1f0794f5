"""Charts render for every stage from a simulated trace, readable at Slack's 480-px preview (text measured), with
the stall marked where the stored verdict event put it, and no projection once finished."""

from __future__ import annotations

import re
import struct

import pytest

from pipeline.observe.charts import HEIGHT_PX, MIN_TEXT_PX, PREVIEW_PX, WIDTH_PX, draw, render
from pipeline.toy.simtrace import Scenario, simulate
from pipeline.verdict import StoredVerdict

pytestmark = pytest.mark.timeout(120)


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("scenario", [
    Scenario("extract", samples=600, order="ascending", per_token2_s=1.5e-7),
    Scenario("stall", samples=600, stall_at_s=300),
    Scenario("train", samples=300, stage="train", overhead_s=0.8, per_token_s=0.0),
])
def test_the_chart_renders_with_its_size(tmp_path, scenario):
    obs = simulate(scenario).observations
    if scenario.stage == "train":
        for i, o in enumerate(obs):
            o["progress"].update(loss=3.0 / (1 + i / 10), kl=1.0 / (1 + i / 10), tokens_per_s=9000.0,
                                 acc_by_depth=[0.8, 0.7])
        for i, o in enumerate(obs):
            o["progress"].update(lr=1e-4 * min(1.0, i / 10))
    events = [{"kind": "stage-restart", "t": obs[len(obs) // 2]["t"]}]
    out = render(obs, stage=scenario.stage, out=tmp_path / "c.png", events=events)
    assert png_size(out) == (WIDTH_PX, HEIGHT_PX)


def text_heights(fig) -> list[tuple[str, float]]:
    """Every visible text of the figure with its height in pixels once the image is shown 480 px wide."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    scale = PREVIEW_PX / (fig.get_figwidth() * fig.dpi)
    return [(t.get_text(), t.get_window_extent(renderer).height * scale) for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip()]


def test_every_text_is_readable_at_slacks_480_px_preview():
    import matplotlib.pyplot as plt

    sc = Scenario("stall", samples=600, stall_at_s=300)
    obs = simulate(sc).observations
    for o in obs:
        o["gpus"] = [{"index": i, "util": 50.0, "mem_used_mb": 70_000.0, "holders": ["extract"]} for i in range(8)]
    fig = draw(obs, stage="extract", events=[{"kind": "verdict", "t": obs[-5]["t"], "data": {"to": "stalled"}}])
    try:
        heights = text_heights(fig)
    finally:
        plt.close(fig)
    assert len(heights) > 20
    small = [(t, round(h, 1)) for t, h in heights if h < MIN_TEXT_PX]
    assert not small, small


def test_the_stall_is_marked_where_the_stored_event_says_and_a_finished_chart_projects_nothing():
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    obs = simulate(Scenario("stall", samples=600, stall_at_s=300)).observations
    at = obs[len(obs) // 2]["t"] + 17.0  # not on a tick: only the stored event can put it there
    fig = draw(obs, stage="extract", events=[{"kind": "verdict", "t": at, "data": {"to": "stalled"}}],
               verdict=StoredVerdict(t=at, stage="extract", verdict="stalled"))
    try:
        ax = fig.axes[0]
        xs = [line.get_xdata()[0] for line in ax.get_lines()
              if line.get_color() == "#c0392b" and len(set(line.get_xdata())) == 1]
        marks = [x.timestamp() if hasattr(x, "timestamp") else mdates.num2date(x).timestamp() for x in xs]
        assert marks == [pytest.approx(at, abs=1e-3)]
        assert ax.get_ylim()[0] == 0 and fig.axes[1].get_ylim()[0] == 0  # progress and rate from 0
    finally:
        plt.close(fig)
    done = draw(obs, stage="extract", verdict=StoredVerdict(t=0.0, stage="extract", verdict="done", eta_s=0.0, final=True))
    running = draw(obs, stage="extract", verdict=StoredVerdict(t=0.0, stage="extract", verdict="progressing", eta_s=600.0, eta_low_s=500.0,
                                                               eta_high_s=700.0))
    try:
        assert "projected (ETA)" not in done.axes[0].get_legend_handles_labels()[1]
        assert "projected (ETA)" in running.axes[0].get_legend_handles_labels()[1]
        assert "time (UTC)" in [a.get_xlabel() for a in done.axes]
    finally:
        plt.close(done)
        plt.close(running)


def test_no_observations_still_draws(tmp_path):
    assert png_size(render([], stage="server", out=tmp_path / "e.png"))[0] == WIDTH_PX


def stamp(x) -> float:
    """Unix seconds of a plotted x (a datetime, or matplotlib's date number)."""
    import matplotlib.dates as mdates

    return x.timestamp() if hasattr(x, "timestamp") else mdates.num2date(x).timestamp()


def test_a_stall_is_shaded_from_its_last_progress_to_its_recovery_and_restarts_and_the_handoff_are_marked():
    """Issue 50: the no-progress span is shaded (not a line at the verdict's time, 31 s to 5 min after progress
    stopped), the flag is a dotted line, the recovery, a restart by hand and the handoff are marked; legends sit
    above their panels; ticks are clock times; no GPU panel where no GPU was ever read; a finished stage's rate
    ends at its last unit instead of dropping to 0."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    obs = simulate(Scenario("stall", samples=600, stall_at_s=300)).observations
    for o in obs:
        o["gpus"] = [{"index": 0, "util": None, "mem_used_mb": None}]  # NVML never answered
    stopped = max(o["t"] for o, prev in zip(obs[1:], obs, strict=False) if o["progress"]["done"] > prev["progress"]["done"])
    flagged, recovered = stopped + 95.0, stopped + 700.0
    events = [{"kind": "verdict", "t": flagged, "data": {"from": "progressing", "to": "stalled"}},
              {"kind": "restart-by-hand", "t": stopped + 400.0},
              {"kind": "verdict", "t": recovered, "data": {"from": "stalled", "to": "progressing"}},
              {"kind": "handoff", "t": obs[-1]["t"] - 5, "data": {"step": "stopping-server"}}]
    fig = draw(obs, stage="extract", events=events)
    try:
        assert len(fig.axes) == 3, "progress, rate (and its tokens axis); no GPU panels"
        ax = fig.axes[0]
        spans = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() > 0]
        xs = sorted(stamp(x) for p in spans for x in (p.get_x(), p.get_x() + p.get_width()))
        assert xs[0] == pytest.approx(stopped, abs=1e-3) and xs[-1] == pytest.approx(recovered, abs=1e-3)
        labels = [t.get_text() for t in ax.texts]
        assert {"stalled", "recovered", "manual", "handoff"} <= set(labels), labels
        fig.canvas.draw()
        for a in fig.axes:
            legend = a.get_legend()
            if legend:
                assert legend.get_window_extent().y0 >= a.get_window_extent().y1 - 1, "a legend above its panel"
        ticks = [t.get_text() for t in fig.axes[-1].get_xticklabels() if t.get_text()]
        assert ticks and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", t) for t in ticks), ticks
    finally:
        plt.close(fig)
    done = simulate(Scenario("extract", samples=300, order="ascending")).observations
    done += [{**done[-1], "t": done[-1]["t"] + 10 * i} for i in range(1, 6)]  # observed on after the last sample
    fig = draw(done, stage="extract")
    try:
        rate = fig.axes[1].get_lines()[0]
        assert min(rate.get_ydata()) > 0, "the rate line does not drop to 0 at the end"
        assert stamp(rate.get_xdata()[-1]) <= done[-6]["t"] + 1e-3
    finally:
        plt.close(fig)
