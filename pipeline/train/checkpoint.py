"""Checkpoints: weights as safetensors, plus optimizer, scheduler and per-rank RNG state.

CKPT_DIR/checkpoints/step_N/ holds one checkpoint; CKPT_DIR/latest names the newest
complete one and is replaced atomically only after every rank has written its part and
flushed it to the disk (a node that loses power right after must not resume from a
`latest` that names files still in the page cache).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.durable import fsync_path
from pipeline.errors import UserError
from pipeline.fileperm import honour_umask
from pipeline.train.outdir import STEP_PREFIX, named_latest


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"{STEP_PREFIX}{step}"


CONFIG_NAME = "draft_config.json"


def save(out: Path, *, step: int, model, opt, sched, rank: int, barrier, config, origin: dict | None = None) -> None:
    """Every rank writes its RNG state; rank 0 the rest (weights, optimizer, the draft's config, and `origin`:
    the run and the data it was trained on, in state.json); then `latest` moves."""
    d = step_dir(out, step)
    d.mkdir(parents=True, exist_ok=True)
    written = [d / f"rng_rank{rank}.pt"]
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, written[0])
    if rank == 0:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(d / "model.safetensors"))
        honour_umask(d / "model.safetensors")
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, d / "optim.pt")
        (d / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=1))
        (d / "state.json").write_text(json.dumps({"step": step, **(origin or {})}))
        written += [d / n for n in ("model.safetensors", "optim.pt", CONFIG_NAME, "state.json")]
    for path in written:  # on the disk before `latest` may name them
        fsync_path(path)
    barrier()
    if rank == 0:
        fsync_path(d)  # the files' entries, and the step's own in checkpoints/
        fsync_path(d.parent)
        tmp = out / ".latest.tmp"
        tmp.write_text(f"{STEP_PREFIX}{step}\n")
        fsync_path(tmp)
        os.replace(tmp, out / "latest")
        fsync_path(out)
    barrier()


def latest_step(out: Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return named_latest(out)


def read_config(d: Path) -> dict:
    """The draft config a checkpoint was written with; a one-line error for an older layout."""
    path = d / CONFIG_NAME
    if not path.exists():
        raise UserError(f"{d}: this checkpoint predates the SGLang draft layout (no {CONFIG_NAME}); "
                        "it cannot be served or resumed: retrain into a new --out")
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise UserError(f"{path}: not JSON") from None


def shape_problem(out: Path, *, step: int, config) -> str | None:
    """Why the checkpoint at `step` cannot be loaded into a draft of `config` (another shape, an older
    layout), or None."""
    d = step_dir(out, step)
    try:
        saved = read_config(d)
    except UserError as exc:
        return str(exc)
    now = config.to_dict()
    diff = [f"{k} {saved.get(k)!r} → {now[k]!r}" for k in now
            if k not in ("aux_layer_ids", "aux_ids", "train_max_length") and saved.get(k) != now[k]]
    return f"the checkpoint at step {step} has another shape ({'; '.join(diff)})" if diff else None


def resume_refused(problem: str) -> UserError:
    """The one-line refusal of a checkpoint that cannot be resumed as asked (`--resume`)."""
    return UserError(f"--resume: {problem}; resume with the flags it was trained with, start over with --fresh "
                     "(the old checkpoints are moved to OUT/previous/), or train into a new --out")


def origin_problem(out: Path, *, step: int, origin: dict) -> str | None:
    """Why the checkpoint at `step` is another training's (another run, other data), or None."""
    d = step_dir(out, step)
    try:
        state = json.loads((d / "state.json").read_text())
    except (OSError, ValueError):
        state = {}
    if origin.get("run") and state.get("run") and state["run"] != origin["run"]:
        return f"the checkpoint at step {step} belongs to run {state['run']}, not to this run ({origin['run']})"
    was, now = state.get("data") or {}, origin.get("data") or {}
    changed = [k for k, v in now.items() if v is not None and was.get(k) is not None and was[k] != v]
    if changed:
        return f"the checkpoint at step {step} was trained on other data ({', '.join(changed)} differ)"
    return None


def load(out: Path, *, step: int, model, opt, sched, rank: int, config) -> None:
    """Restore a checkpoint written by `save` (refusing one of another shape or layout)."""
    d = step_dir(out, step)
    problem = shape_problem(out, step=step, config=config)
    if problem:
        raise resume_refused(problem)
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    optim = torch.load(d / "optim.pt", weights_only=False)
    opt.load_state_dict(optim["optimizer"])
    sched.load_state_dict(optim["scheduler"])
    rng_file = d / f"rng_rank{rank}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
