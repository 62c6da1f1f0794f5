"""Training data: the extraction output, checked before step 1, batched by a token budget.

A missing or corrupt sample file is an error naming the file — never silently replaced
by another sample (SpecForge trains on sample 0 when a file fails to load) — unless
--skip-bad, which counts and reports them. The order of batches is a pure function
of (seed, epoch), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.errors import UserError
from pipeline.layout import sample_path
from pipeline.manifest import MANIFEST_NAME, read_done

IDENTITY_KEYS = ("dataset_sha256", "samples_total", "model")  # manifest meta: which data a checkpoint learned


@dataclass(frozen=True)
class SampleInfo:
    """One usable sample file and its length."""

    idx: int
    path: Path
    tokens: int


@dataclass
class Corpus:
    """The checked samples, split into train and validation, and the layout they share."""

    train: list[SampleInfo]
    val: list[SampleInfo]
    layers: int  # 4: aux + final; 3: aux only (top-K targets stored)
    hidden: int
    topk: int
    bad: list[str]
    final_slot: str | None = None  # 'post-norm' (this project's extraction) or 'pre-norm' (speculators' files)
    layer_ids: list[int] | None = None  # the aux ids as the manifest records them (pipeline/draft/capture.py)
    layer_convention: str | None = None  # the manifest's: capture.SERVER_IDS, or LAYER_INPUTS on older ones
    identity: dict = field(default_factory=dict)  # what the data is (the manifest's dataset hash, size, model)
    cut: int = 0  # samples longer than --max-length, cut to it


def _expect(path: Path, name: str, shape, want) -> None:
    if len(shape) != len(want) or any(w is not None and s != w for s, w in zip(shape, want, strict=False)):
        raise UserError(f"{path}: tensor {name} has shape {list(shape)}, expected "
                        f"[{', '.join('seq' if w is None else str(w) for w in want)}] (data from another model or layout?)")


def _inspect(path: Path, hidden: int | None, layers: int | None) -> tuple[int, int, int, int]:
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for key in ("token_ids", "hidden_states"):
            if key not in keys:
                raise UserError(f"{path}: tensor {key} missing; expected token_ids [seq] and hidden_states [seq, L, H]")
        seq = f.get_slice("token_ids").get_shape()
        hs = f.get_slice("hidden_states").get_shape()
        _expect(path, "token_ids", seq, [None])
        _expect(path, "hidden_states", hs, [seq[0], layers, hidden])
        if hs[1] not in (3, 4):
            raise UserError(f"{path}: hidden_states has {hs[1]} layers, expected 4 (3 aux + final) or 3 (aux only)")
        topk = 0
        if hs[1] == 3:
            if "target_topk_ids" not in keys or "target_topk_logprobs" not in keys:
                raise UserError(f"{path}: no final layer and no target_topk_ids/target_topk_logprobs: nothing to train against")
            topk = f.get_slice("target_topk_ids").get_shape()[1]
            _expect(path, "target_topk_logprobs", f.get_slice("target_topk_logprobs").get_shape(), [seq[0], topk])
    return seq[0], hs[1], hs[2], topk


def load_corpus(data_dir: Path, *, skip_bad: bool, val_share: float = 0.05, max_length: int | None = None) -> Corpus:
    """Read the manifest, check every done file's header, split deterministically by index. A sample longer
    than `max_length` tokens is cut to its first `max_length` (counted in `cut`): one sample alone must fit
    a batch's memory (the draft's T×T attention)."""
    mpath = Path(data_dir) / MANIFEST_NAME
    if not mpath.exists():
        raise UserError(f"{mpath}: no manifest; --data must be an extraction output directory")
    try:
        meta, done = read_done(Path(data_dir))
    except sqlite3.Error as exc:
        raise UserError(f"{mpath}: unreadable manifest ({exc})") from None
    samples, bad, hidden, layers, topk, cut = [], [], None, None, 0, 0
    for idx in done:
        path = sample_path(Path(data_dir), idx)
        try:
            seq, layers, hidden, topk = _inspect(path, hidden, layers)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - missing or corrupt file
            problem = f"{path}: unreadable ({type(exc).__name__}: {exc})"
            if not skip_bad:
                raise UserError(problem + "; fix or re-extract it, or pass --skip-bad to leave it out") from None
            bad.append(problem)
            continue
        if max_length is not None and seq > max_length:
            seq, cut = max_length, cut + 1
        if seq >= 2:
            samples.append(SampleInfo(idx, path, seq))
    if not samples or layers is None or hidden is None:  # (a sample is kept only once its file was read)
        raise UserError(f"{data_dir}: no usable samples")
    val = [s for s in samples if random.Random(s.idx).random() < val_share] or samples[:1]
    val_ids = {s.idx for s in val}
    slot = meta.get("final_slot") or "post-norm"  # manifests before the field: this project's server, post-norm
    if slot not in ("post-norm", "pre-norm"):
        raise UserError(f"{mpath}: meta final_slot is {slot!r}; expected 'post-norm' or 'pre-norm'")
    try:
        layer_ids = json.loads(meta["layer_ids"]) if meta.get("layer_ids") else None
    except ValueError:
        layer_ids = None
    return Corpus([s for s in samples if s.idx not in val_ids], val, layers, hidden, topk, bad,
                  final_slot=slot if layers == 4 else None, layer_ids=layer_ids,
                  layer_convention=meta.get("layer_convention"),
                  identity={k: meta.get(k) for k in IDENTITY_KEYS}, cut=cut)


def token_counts(samples: list[SampleInfo], vocab: int) -> torch.Tensor:
    """How often each target token occurs where the loss mask is on (every token without one)."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in samples:
        with safe_open(str(s.path), framework="pt") as f:
            ids = f.get_tensor("token_ids")
            if "loss_mask" in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                ids = ids[f.get_tensor("loss_mask").bool()]
        if ids.numel() and int(ids.max()) >= vocab:
            raise UserError(f"{s.path}: token id {int(ids.max())} is outside the target's vocabulary ({vocab}): "
                            "data from another model?")
        counts += torch.bincount(ids, minlength=vocab)
    return counts


def target_mass(samples: list[SampleInfo], in_draft: torch.Tensor, *, limit: int = 64) -> tuple[float, float] | None:
    """How much of the target's probability the training targets hold, over up to `limit` samples spread through
    the data: (in the stored top-K, in the top-K ∩ the draft vocabulary that is renormalised to 1), each the mean
    over positions; None where the data has no top-K (the final layer gives the whole distribution)."""
    step = max(1, len(samples) // limit)
    topk_sum = draft_sum = 0.0
    rows = 0
    for s in samples[::step][:limit]:
        with safe_open(str(s.path), framework="pt") as f:
            if "target_topk_logprobs" not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return None
            p = f.get_tensor("target_topk_logprobs").double().exp()
            ids = f.get_tensor("target_topk_ids")
        topk_sum += float(p.sum())
        draft_sum += float((p * in_draft[ids.clamp(0, in_draft.numel() - 1)]).sum())
        rows += p.shape[0]
    return (topk_sum / rows, draft_sum / rows) if rows else None


def batches(samples: list[SampleInfo], *, budget: int, seed: int, epoch: int) -> list[list[SampleInfo]]:
    """Length-aware batches under a token budget (padded size), in an order fixed by (seed, epoch)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = sorted(samples, key=lambda s: (s.tokens, rng.random()))
    out: list[list[SampleInfo]] = []
    cur: list[SampleInfo] = []
    for s in order:
        if cur and (len(cur) + 1) * max(s.tokens, cur[-1].tokens) > budget:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def load_batch(batch: list[SampleInfo], *, bad: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Pad a batch: token_ids [B, T], aux [B, T, 3H], final [B, T, H] or top-K, mask and loss_mask [B, T].

    Hidden states keep the dtype they were stored in (bf16 from a real extraction: half the bytes to copy);
    `to_device` gives the CPU trainer float32. Padding is on the right (the attention relies on it).
    """
    from safetensors.torch import load_file

    loaded = []
    for s in batch:
        try:
            # the first s.tokens rows: a sample longer than --max-length is cut (SampleInfo.tokens)
            loaded.append({k: v[: s.tokens] if v.dim() else v for k, v in load_file(str(s.path)).items()})
        except Exception as exc:  # noqa: BLE001
            if bad is None:
                raise UserError(f"{s.path}: unreadable during training ({type(exc).__name__}); "
                                "re-extract it or pass --skip-bad") from None
            bad.append(f"{s.path}: {type(exc).__name__}")
    if not loaded:
        raise UserError("a whole batch was unreadable")
    T = max(t["token_ids"].shape[0] for t in loaded)
    B = len(loaded)
    hs0 = loaded[0]["hidden_states"]
    H, dtype = hs0.shape[2], hs0.dtype
    out = {"token_ids": torch.zeros(B, T, dtype=torch.long), "mask": torch.zeros(B, T, dtype=torch.bool),
           "loss_mask": torch.zeros(B, T, dtype=torch.bool), "aux": torch.zeros(B, T, 3 * H, dtype=dtype)}
    if hs0.shape[1] == 4:
        out["final"] = torch.zeros(B, T, H, dtype=dtype)
    else:
        k = loaded[0]["target_topk_ids"].shape[1]
        out["topk_ids"] = torch.zeros(B, T, k, dtype=torch.long)
        out["topk_logprobs"] = torch.full((B, T, k), -1e4)
    for b, t in enumerate(loaded):
        n = t["token_ids"].shape[0]
        hs = t["hidden_states"]
        out["token_ids"][b, :n] = t["token_ids"]
        out["mask"][b, :n] = True
        out["loss_mask"][b, :n] = t["loss_mask"].bool() if "loss_mask" in t else True
        out["aux"][b, :n] = hs[:, :3].reshape(n, 3 * H)
        if "final" in out:
            out["final"][b, :n] = hs[:, 3]
        else:
            out["topk_ids"][b, :n] = t["target_topk_ids"]
            out["topk_logprobs"][b, :n] = t["target_topk_logprobs"].float()
    return out


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on the training device: on a GPU copied as stored (bf16 stays bf16; autocast reads it),
    without waiting when the loader pinned it; on the CPU floating tensors become float32."""
    if device.type == "cpu":
        return {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class EpochBatches:
    """This rank's batches, numbered from 1 across epochs (--grad-accum of them per step): a pure function of
    (seed, number), so resume is exact. Each epoch's batching is computed once, when its first batch is asked."""

    def __init__(self, samples: list[SampleInfo], *, budget: int, seed: int, world: int, rank: int) -> None:
        self.samples, self.budget, self.seed, self.world, self.rank = samples, budget, seed, world, rank
        self.per_rank = max(1, len(batches(samples, budget=budget, seed=seed, epoch=0)) // world)
        self.epoch: int | None = None
        self.order: list[list[SampleInfo]] = []

    def __call__(self, number: int) -> list[SampleInfo]:
        epoch, i = divmod(number - 1, self.per_rank)
        if epoch != self.epoch:
            self.epoch, self.order = epoch, batches(self.samples, budget=self.budget, seed=self.seed, epoch=epoch)
        return self.order[(i * self.world + self.rank) % len(self.order)]


class BatchStream(torch.utils.data.Dataset):
    """Batches `first`..`last` of one rank, loaded and padded (in worker processes when asked), each with the
    files --skip-bad left out of it."""

    def __init__(self, plan: EpochBatches, first: int, last: int, *, skip_bad: bool) -> None:
        self.plan, self.first, self.last, self.skip_bad = plan, first, last, skip_bad

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __getitem__(self, i: int):
        bad: list[str] | None = [] if self.skip_bad else None
        return load_batch(self.plan(self.first + i), bad=bad), bad or []


def _quiet_worker(_: int) -> None:
    """A loader worker ignores SIGTERM/SIGINT: the trainer saves its checkpoint on SIGTERM and needs the next
    batch meanwhile; the workers end with it."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def loader(stream: BatchStream, *, workers: int, pin: bool, prefetch: int = 2):
    """Batches in order, prepared ahead by `workers` processes (0: in this process), pinned for a GPU."""
    return torch.utils.data.DataLoader(
        stream, batch_size=None, shuffle=False, num_workers=workers, pin_memory=pin,
        prefetch_factor=prefetch if workers else None, worker_init_fn=_quiet_worker if workers else None)
