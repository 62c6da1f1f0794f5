"""Charts render for every stage from a simulated trace, at Slack's preview size or more."""

from __future__ import annotations

import struct

import pytest

from pipeline.observe.charts import HEIGHT_PX, WIDTH_PX, render
from pipeline.toy.simtrace import Scenario, simulate

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
    events = [{"kind": "stage-restart", "t": obs[len(obs) // 2]["t"]}]
    out = render(obs, stage=scenario.stage, out=tmp_path / "c.png", events=events)
    w, h = png_size(out)
    assert w >= 1000 and h >= 600 and (w, h) == (WIDTH_PX, HEIGHT_PX)


def test_no_observations_still_draws(tmp_path):
    assert png_size(render([], stage="server", out=tmp_path / "e.png"))[0] == WIDTH_PX
