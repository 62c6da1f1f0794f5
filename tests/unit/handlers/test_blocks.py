"""Status post details: what an operator expects to read for each stage."""

from __future__ import annotations

from handlers.blocks import _details


def test_training_details_show_loss_kl_and_steps_per_second():
    st = {"state": "running", "progress_pct": 40.0, "done": 120, "failed": 0, "total": 300,
          "rate_samples_per_s": 2.5, "rate_tokens_per_s": 9000.0,
          "progress": {"done": 120, "total": 300, "unit": "steps", "loss": 2.5123, "kl": 0.0421}}
    text = "\n".join(_details("train", st, now=1_790_000_000.0))
    assert "loss 2.512 · kl 0.042 · 2.50 steps/s · 9,000 tokens/s" in text
    assert "samples/s" not in text
    ex = "\n".join(_details("extract", {**st, "progress": {"unit": "samples"}}, now=1_790_000_000.0))
    assert "2.50 samples/s" in ex and "loss" not in ex
