"""Status post details: what an operator expects to read for each stage."""

from __future__ import annotations

from dataclasses import replace

from handlers.render.blocks import _details
from pipeline.status import StageStatus


def test_training_details_show_loss_kl_and_steps_per_second():
    st = StageStatus.from_json({
        "state": "running", "progress_pct": 40.0, "done": 120, "failed": 0, "total": 300,
        "rate_samples_per_s": 2.5, "rate_tokens_per_s": 9000.0,
        "progress": {"done": 120, "total": 300, "unit": "steps", "loss": 2.5123, "kl": 0.0421,
                     "acc_by_depth": [0.891, 0.88, None], "validated_at_step": 100}})
    text = "\n".join(_details("train", st, now=1_790_000_000.0))
    assert ("loss 2.512 · kl 0.042 · top-1 by depth 0.89/0.88/- (validation at step 100) · 2.50 steps/s · "
            "9,000 tokens/s") in text
    assert "samples/s" not in text
    ex = "\n".join(_details("extract", replace(st, progress={"unit": "samples"}), now=1_790_000_000.0))
    assert "2.50 samples/s" in ex and "loss" not in ex


def test_gpus_like_gpustat_with_unknowns_shown_as_unknown():
    from handlers.render.views import gpus_text

    text = gpus_text([
        {"index": 0, "name": "NVIDIA H200", "util": 97.0, "mem_used_mb": 75000.0, "mem_total_mb": 143771.0,
         "power_w": 610.0, "power_limit_w": 700.0, "temp_c": 61.0, "holders": ["extract"], "pids": [11]},
        {"index": 1, "util": None, "mem_used_mb": 512.0, "power_w": None, "holders": [], "pids": []},
    ])
    first, second = text.splitlines()
    assert first == "[0] NVIDIA H200            |  97 % |  75,000 / 143,771 MB | 610 / 700 W | 61 °C | extract"
    assert "|   ? % |" in second and "? / ? W" in second and "? °C" in second and second.endswith("| -")
    assert gpus_text(None, why="NVML unavailable") == "GPUs: no reading (NVML unavailable)"
    assert gpus_text(None) == "GPUs: no reading yet"
