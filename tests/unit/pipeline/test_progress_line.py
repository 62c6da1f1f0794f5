"""The extraction's own progress line shows the monitor's ETA (one estimator), early with a band."""

import io
import time

from pipeline.extract.progress_line import ProgressLine


def test_the_progress_line_uses_the_cost_model_with_a_band():
    clock = {"t": 0.0}
    out = io.StringIO()
    line = ProgressLine(total=1000, done=0, tokens_total=200_000, tokens_left=200_000, log=out, every_s=5.0,
                        clock=lambda: clock["t"])
    for _ in range(200):  # 1 s a sample, 200 tokens each: 800 s left at the end
        clock["t"] += 1.0
        line.add(ok=True, tokens=200)
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("extract: 200 / 1,000 (20.0 %)") and "failed 0" in last
    assert "ETA 13m" in last and "–" in last, last  # 800 s, with its band


def test_no_eta_before_three_intervals():
    out = io.StringIO()
    clock = {"t": 0.0}
    line = ProgressLine(total=100, done=0, tokens_total=100, tokens_left=100, log=out, every_s=5.0,
                        clock=lambda: clock["t"])
    clock["t"] = 6.0
    line.add(ok=True, tokens=1)
    assert "no ETA yet (0 span(s) of progress observed since watching began; an ETA needs 3)" in out.getvalue()


def test_eta_line_gives_the_band_and_the_finish_time():
    from dataclasses import replace

    from handlers.render.views import eta_line
    from pipeline.status import StageStatus

    st = StageStatus.from_json({"state": "running", "verdict": "progressing", "progress_pct": 49.4, "done": 18421,
                                "failed": 3, "total": 37312, "eta_s": 17280.0, "eta_low_s": 15000.0,
                                "eta_high_s": 19800.0})
    line = eta_line("extract", st, now=1_790_000_000.0)
    assert line.startswith("*extract*: progressing, 49.4 % (18,424 / 37,312), ETA 4h 48m (4h 10m–5h 30m)")
    assert "finishing around" in line
    early = eta_line("extract", replace(st, diagnosis=replace(st.diagnosis, eta_s=None, reasons=("last progress 3s ago",))))
    assert early.endswith("no ETA yet (last progress 3s ago)")


def test_slack_times_render_in_the_readers_zone_and_plain_on_a_terminal():
    from handlers.render.blocks import blocks_text
    from handlers.render.views import eta_line, slack_time

    t = 1_790_000_000
    assert slack_time(t) == f"<!date^{t}^{{time}}|{time.strftime('%H:%M UTC', time.gmtime(t))}>"
    from pipeline.status import StageStatus

    st = StageStatus.from_json({"state": "running", "verdict": "progressing", "progress_pct": 49.4, "done": 18424,
                                "failed": 0, "total": 37312, "eta_s": 3600.0, "eta_low_s": 3000.0, "eta_high_s": 4000.0})
    line = eta_line("extract", st, now=t - 3600.0, slack=True)
    assert f"finishing around <!date^{t}^{{date_short_pretty}} {{time}}|" in line
    shown = blocks_text([{"type": "section", "text": {"type": "mrkdwn", "text": line}}])
    assert "<!date" not in shown and time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) in shown
