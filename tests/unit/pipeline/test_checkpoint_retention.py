"""Checkpoints do not grow forever: the trainer keeps the newest --keep-last and the best by validation,
OUT/previous/ keeps each earlier training's draft and logs and the newest ones' last and best checkpoints,
and the disk the kept checkpoints will need is projected from the first one saved (torch-free parts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.train.outdir import (
    accepted_length,
    best_validated,
    checkpoint_fit,
    prune,
    saves_after,
    set_aside,
    steps_saved,
)

pytestmark = pytest.mark.timeout(30)


def _training(out: Path, steps: list[int], *, size: int = 1000, validated: dict[int, list] | None = None) -> None:
    for s in steps:
        d = out / "checkpoints" / f"step_{s}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"w" * size)
        (d / "optim.pt").write_bytes(b"o" * 2 * size)
    (out / "latest").write_text(f"step_{steps[-1]}\n")
    (out / "progress.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps[-1] + 1)))
    if validated:
        (out / "validation.jsonl").write_text("".join(json.dumps({"step": s, "acc": a}) + "\n"
                                                      for s, a in validated.items()))


def test_keeps_the_newest_and_the_best_by_validation(tmp_path):
    _training(tmp_path, [50, 100, 150, 200, 250, 300], validated={100: [0.8, 0.6], 200: [0.7, 0.5], 300: [0.6, 0.5]})
    assert accepted_length([0.8, 0.6]) == pytest.approx(0.8 + 0.48) and accepted_length([None, 0.9]) == 0.0
    assert best_validated(tmp_path) == 100
    assert prune(tmp_path, keep_last=2) == [50, 150, 200]
    assert steps_saved(tmp_path) == [100, 250, 300]
    assert prune(tmp_path, keep_last=0) == [] and steps_saved(tmp_path) == [100, 250, 300]


def test_a_step_past_latest_is_a_save_cut_short_and_left_alone(tmp_path):
    _training(tmp_path, [2, 4, 6, 8])
    (tmp_path / "latest").write_text("step_6\n")
    assert prune(tmp_path, keep_last=1) == [2, 4]
    assert steps_saved(tmp_path) == [6, 8]


def test_previous_keeps_drafts_and_logs_and_the_newest_trainings_last_and_best(tmp_path):
    for n in range(4):  # four earlier trainings set aside one after another
        _training(tmp_path, [10, 20, 30], validated={10: [0.9], 30: [0.5]})
        (tmp_path / "draft").mkdir()
        (tmp_path / "draft" / "model.safetensors").write_bytes(b"d")
        assert set_aside(tmp_path, now=1_790_000_000 + n, keep_previous=2) is not None
    olds = sorted((tmp_path / "previous").iterdir())
    assert len(olds) == 4 and all((d / "draft" / "model.safetensors").exists() for d in olds)
    assert all((d / "progress.jsonl").exists() and (d / "validation.jsonl").exists() for d in olds)
    assert [steps_saved(d) for d in olds] == [[], [], [10, 30], [10, 30]]
    assert not (olds[0] / "latest").exists() and (olds[-1] / "latest").read_text() == "step_30\n"


def test_the_kept_checkpoints_and_the_draft_are_projected_against_the_free_space(tmp_path):
    _training(tmp_path, [50], size=1000)  # 3000 bytes a checkpoint, 1000 of them weights
    assert saves_after(50, steps=300, save_every=50, eval_every=0) == 5
    assert saves_after(50, steps=310, save_every=50, eval_every=75) == 5 + 2 + 1  # 100..300; 75, 225; 310
    fit = checkpoint_fit(tmp_path, step=50, keep_last=3, steps=300, save_every=50, eval_every=0)
    assert fit.checkpoint_bytes == 3000 and fit.need_bytes == 4 * 3000 + 1000  # peak 5 held; 1 already; the draft
    assert fit.problem is None  # a test machine has more than 13 kB free
    everything = checkpoint_fit(tmp_path, step=50, keep_last=0, steps=20_050, save_every=50, eval_every=0)
    assert everything.need_bytes == 400 * 3000 + 1000
    tight = type(fit)(fit.checkpoint_bytes, fit.need_bytes, free_bytes=5000)
    assert "will not fit" in tight.problem and "13.0 KB more, 5.0 KB free" in tight.problem
