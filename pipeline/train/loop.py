"""`python -m pipeline.train`: the trainer's entry point and main loop (run under torchrun)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import RUN_ENV
from pipeline.draft import capture, rope
from pipeline.errors import UserError
from pipeline.manifest import MASS_WARN
from pipeline.train import checkpoint
from pipeline.train.data import (
    BatchStream,
    Corpus,
    EpochBatches,
    batches,
    load_batch,
    load_corpus,
    loader,
    target_mass,
    to_device,
    token_counts,
)
from pipeline.train.export import context_warning, export_checkpoint, launch_line, tp_line
from pipeline.train.flight import serve_dumps
from pipeline.train.model import (
    DraftConfig,
    Eagle3Draft,
    RMSNorm,
    TargetHead,
    build_target,
    draft_vocab,
    frozen,
)
from pipeline.train.outdir import KEEP_LAST, KEEP_PREVIOUS, checkpoint_fit, prune, set_aside
from pipeline.train.target import Target, load_target

DEFAULT_DRAFT_VOCAB = 32000
DEFAULT_MAX_LENGTH = 2048


class TrainError(UserError):
    """Training stopped on a numerical failure."""

    exit_code = 3


class RankDeviceError(UserError):
    """This rank has no GPU of its own: said by the rank itself (the others may be fine)."""


def parser(prog: str = "python -m pipeline.train", epilog: str | None = None) -> argparse.ArgumentParser:
    """The trainer's arguments (also `eagle3 train`, which names itself and its example)."""
    p = argparse.ArgumentParser(prog=prog, description="Train an EAGLE-3 draft head.", epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="extraction output directory")
    p.add_argument("--target-model", "--lm-head", dest="target_model", metavar="DIR",
                   help="the target's Hugging Face directory: its embedding, lm_head and final norm are read "
                        "through the safetensors index (--lm-head: the older name)")
    p.add_argument("--out", required=True, help="checkpoint directory (progress.jsonl goes here; the draft for "
                                               "SGLang is exported to OUT/draft at the end)")
    p.add_argument("--steps", type=int, help="train up to this optimizer step (or give --epochs)")
    p.add_argument("--epochs", type=float,
                   help=f"train this many passes over the training samples (default {DEFAULT_EPOCHS:g}, SpecForge's "
                        "num_epochs, when --steps is not given): steps = epochs × batches per rank / --grad-accum")
    p.add_argument("--resume", action="store_true",
                   help="resuming is the default: training continues from --out's latest checkpoint when it is this "
                        "training's (same shape, run and data); with --resume a checkpoint of another shape is "
                        "refused instead of moved aside")
    p.add_argument("--fresh", action="store_true",
                   help="start over at step 1: an earlier training's checkpoints, progress and draft in --out are "
                        "moved to OUT/previous/<time>/ (never deleted, never mixed)")
    p.add_argument("--skip-bad", action="store_true", help="leave out missing or corrupt sample files (counted)")
    p.add_argument("--ttt", type=int, default=7, help="training-time-test unroll steps (default 7)")
    p.add_argument("--draft-vocab", type=int, help="draft vocabulary: the N most frequent target tokens of the "
                                                   "loss-masked data (default 32000, or the target's if smaller)")
    p.add_argument("--heads", type=int, help="attention heads (default: the target's num_attention_heads; for "
                                             "Kimi-K2/K2.5, 64 at hidden 7168 as SpecForge's Kimi draft, which splits "
                                             "at TP 16; for another MLA target such as DeepSeek, hidden/128 as "
                                             "SpecForge's DeepSeek-V3 draft)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: the target's num_key_value_heads; 8 for an "
                                                "MLA target)")
    p.add_argument("--head-dim", type=int, help="width of each head (default: the target's head_dim, else hidden/heads; "
                                                "128 for an MLA target)")
    p.add_argument("--intermediate", type=int, help="MLP width (default: the target's intermediate_size; for an MLA "
                                                    "target 40960 at hidden 7168, SpecForge's DeepSeek-V3 draft)")
    p.add_argument("--token-budget", type=int, default=4096, help="padded tokens per batch per rank")
    p.add_argument("--max-length", type=int,
                   help="samples longer than this many tokens are cut to it (counted and reported); at most "
                        f"--token-budget (default {DEFAULT_MAX_LENGTH}, or the token budget if smaller)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--warmup-ratio", type=float, default=0.015,
                   help="share of --steps spent warming the learning rate up linearly (default 0.015)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="after warm-up: cosine decay to 0 at --steps (default), or constant")
    p.add_argument("--max-grad-norm", type=float, default=0.5, help="gradient clipping norm (default 0.5)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="batches per optimizer step on each rank (default 1): the effective batch is "
                        "token budget × ranks × this")
    p.add_argument("--workers", type=int,
                   help="processes that load and pad the next batches while the GPU computes (default 4 on a GPU, "
                        "0 on the CPU, where they would compete with training for the same cores)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layer and the final norm (in place: checkpoints keep their names); "
                        "off by default until it measures faster on a GPU (bench/gpu_train.py --compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep-last", type=int, default=KEEP_LAST,
                   help=f"checkpoints kept besides the best by validation (default {KEEP_LAST}; 0 keeps every one); "
                        "older ones are deleted after each save, the exported draft never")
    p.add_argument("--keep-previous", type=int, default=KEEP_PREVIOUS,
                   help=f"earlier trainings in OUT/previous/ that keep their last and best checkpoints (default "
                        f"{KEEP_PREVIOUS}); every earlier training keeps its draft, progress and validation")
    p.add_argument("--eval-every", type=int, default=0,
                   help="validation every N steps (default: at the end); a validated step is checkpointed, so the best "
                        "by validation can be kept")
    return p


def rank_device(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK where CUDA is available, refusing a rank past the visible GPUs in one line (a
    2-process demo on a 1-GPU workstation asked for cuda:1 and died with a CUDA traceback); else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise RankDeviceError(f"rank {local_rank} needs cuda:{local_rank} but {visible} GPU(s) are visible; use "
                              f"--nproc-per-node {visible} or set CUDA_VISIBLE_DEVICES (\"\" to train on the CPU)")
    return torch.device(f"cuda:{local_rank}")


class Dist:
    """torch.distributed when launched by torchrun; a no-op single process otherwise."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = rank_device(int(os.environ.get("LOCAL_RANK", 0)))
        if self.world > 1:
            one_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) == self.world
            if self.device.type == "cpu" and one_node:  # all ranks here: never bind another interface; across
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # nodes, gloo's own choice (the host's name)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend)
            serve_dumps(self.rank, backend)  # "why is it stuck?" reads the collective each rank is in

    def mean(self, values: list) -> list[float]:
        """The ranks' mean of each value (numbers, or 0-d tensors on this rank's device): one read."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])
        if self.world > 1:
            dist.all_reduce(t)
            t /= self.world
        return t.tolist()

    def any(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            dist.destroy_process_group()


DEFAULT_EPOCHS = 10.0  # SpecForge's train_eagle3.py --num-epochs default

# SpecForge's EAGLE-3 draft for DeepSeek-V3 (configs/deepseek-v3-671b-eagle3.json): 128-wide heads, 8 KV heads,
# MLP 40960 at hidden 7168. An MLA target's own attention (64 heads of a 192-wide query, a 512-rank latent KV) is not
# a shape a Llama draft layer can take.
MLA_HEAD_DIM, MLA_KV_HEADS, MLA_INTERMEDIATE_PER_HIDDEN = 128, 8, 40960 / 7168
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")


# SpecForge's EAGLE-3 draft for Kimi-K2.5 (configs/kimi-k25-eagle3.json): 64 heads × 128 and 64 KV heads at hidden
# 7168 (they split across TP 16, where DeepSeek-V3's 56 = 7168/128 would not), MLP 18,432, RoPE θ 1e6 unscaled.
KIMI_TYPES = frozenset({"kimi_k2", "kimi_k25"})
KIMI_HEADS_PER_HIDDEN, KIMI_INTERMEDIATE_PER_HIDDEN, KIMI_ROPE_THETA = 64 / 7168, 18432 / 7168, 1e6


def is_kimi(config: dict) -> bool:
    """A Kimi-K2 / K2.5 target (its text config's model_type)."""
    return config.get("model_type") in KIMI_TYPES


def is_mla(config: dict) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the config has the latent ranks."""
    return any(config.get(k) is not None for k in MLA_KEYS)


def draft_shape(args, c: dict, H: int) -> tuple[dict, str]:
    """(heads, kv_heads, head_dim, intermediate) of the draft layer, and where they came from."""
    if is_kimi(c):
        head_dim = args.head_dim or MLA_HEAD_DIM
        heads = args.heads or max(1, round(H * KIMI_HEADS_PER_HIDDEN))
        kv = args.kv_heads or heads
        inter = args.intermediate or max(128, int(round(H * KIMI_INTERMEDIATE_PER_HIDDEN / 128)) * 128)
        why = "a Kimi-K2 target: SpecForge's Kimi-K2.5 EAGLE-3 shape"
    elif is_mla(c):
        head_dim = args.head_dim or MLA_HEAD_DIM
        heads = args.heads or max(1, H // head_dim)
        kv = args.kv_heads or (MLA_KV_HEADS if heads % MLA_KV_HEADS == 0 else heads)
        inter = args.intermediate or int(round(H * MLA_INTERMEDIATE_PER_HIDDEN / 128)) * 128
        why = "an MLA target: SpecForge's DeepSeek-V3 EAGLE-3 shape"
    else:
        heads = args.heads or c.get("num_attention_heads") or max(1, H // 128)
        kv = args.kv_heads or c.get("num_key_value_heads") or heads
        head_dim = args.head_dim or (c.get("head_dim") if not args.heads else None)
        inter = args.intermediate or c.get("intermediate_size") or 4 * H
        why = "the target's attention and MLP"
    derived = not head_dim  # hidden / heads
    head_dim = head_dim or H // heads
    if heads % kv or (derived and head_dim * heads != H):
        raise UserError(f"--heads {heads} / --kv-heads {kv}: the heads must divide by the key/value heads, and the "
                        f"hidden size {H} by the heads unless --head-dim is given")
    overridden = [f for f, v in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim),
                                 ("--intermediate", args.intermediate)) if v]
    if overridden:
        why += " (" + ", ".join(overridden) + " given)"
    return {"num_attention_heads": int(heads), "num_key_value_heads": int(kv), "head_dim": int(head_dim),
            "intermediate_size": int(inter)}, why


def draft_config(args, corpus: Corpus, target: Target) -> DraftConfig:
    """The draft's shapes: hidden size = the target's; attention and MLP from the target's config (SpecForge's
    shape for MLA targets) or flags; RoPE as the target's config gives it, refused before step 1 where SGLang
    would serve the draft with other angles (pipeline/draft/rope.py)."""
    c = target.config
    H = target.hidden
    shape, _ = draft_shape(args, c, H)
    want = args.draft_vocab if args.draft_vocab is not None else min(DEFAULT_DRAFT_VOCAB, target.vocab)
    if not 1 <= want <= target.vocab:
        raise UserError(f"--draft-vocab {want}: must be between 1 and the target's vocabulary ({target.vocab})")
    try:
        # the draft's own RoPE, as SGLang serves the draft by its config.json: the target's, except for Kimi,
        # whose SpecForge draft is trained and served at θ 1e6 unscaled
        theta, scaling = (KIMI_ROPE_THETA, None) if is_kimi(c) else rope.from_config(c)
    except rope.RopeError as exc:
        raise rope.RopeError(f"--target-model {target.source}: config {exc}") from None
    return DraftConfig(
        hidden_size=H, target_hidden_size=corpus.hidden, **shape,
        vocab_size=target.vocab, draft_vocab_size=want, rms_norm_eps=float(c.get("rms_norm_eps") or 1e-5),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
        aux_layer_ids=capture.draft_ids(corpus.layer_ids, corpus.layer_convention, c.get("num_hidden_layers"),
                                        model=corpus.identity.get("model")), aux_ids=capture.AUX_IDS_EAGLE_CONFIG,
        train_max_length=args.max_length)


def validate(model, corpus: Corpus, head: TargetHead, final_norm, args, device) -> dict:
    """Top-1 accuracy of each unrolled step against the target's argmax, and the most-frequent-token baseline."""
    hits, counts, argmaxes = [0] * args.ttt, [0] * args.ttt, Counter[int]()
    model.eval()
    with torch.no_grad():
        for b in batches(corpus.val, budget=args.token_budget, seed=args.seed, epoch=0):
            batch = to_device(load_batch(b), device)
            tgt = build_target(batch, model, head, final_norm)
            with _autocast(device):
                _, _, acc = model(batch, tgt, steps=args.ttt)
            for k, (h, n) in enumerate(acc.tolist()):
                hits[k] += h
                counts[k] += n
            argmaxes.update(tgt["top"][tgt["valid"]].tolist())
    model.train()
    total = sum(argmaxes.values())
    return {"acc": [h / n if n else None for h, n in zip(hits, counts, strict=True)],
            "baseline_top1": argmaxes.most_common(1)[0][1] / total if total else None}


def build(args, corpus: Corpus, target: Target, d: Dist) -> tuple[Eagle3Draft, DraftConfig]:
    """The draft, its vocabulary from the loss-masked data, lm_head and norm started from the target's."""
    cfg = draft_config(args, corpus, target)
    torch.manual_seed(args.seed)
    model = Eagle3Draft(cfg, frozen(target.embed, d.device))  # straight to the device, never an fp32 copy on a GPU
    d2t, t2d = draft_vocab(token_counts(corpus.train, target.vocab), cfg.draft_vocab_size)
    model.set_vocab(d2t, t2d)
    with torch.no_grad():
        model.lm_head.weight.copy_(target.head[model.hot_ids()])
        if target.norm is not None:
            model.norm.weight.copy_(target.norm)
    return model.to(d.device), cfg


def compile_draft(model: Eagle3Draft) -> None:
    """torch.compile the unrolled layer (attention projections, RoPE, MLP, norms) and the final norm, in place."""
    model.midlayer.compile()
    model.norm.compile()


def run(args: argparse.Namespace) -> int:
    """Load, (resume,) step, save, validate, export."""
    d = Dist()
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        _check_args(args)
        corpus = load_corpus(Path(args.data), skip_bad=args.skip_bad, max_length=args.max_length)
        if not args.target_model:
            raise UserError("pass --target-model DIR (the target's Hugging Face directory): the draft uses the "
                            "target's embedding, and its LM head to form the training target")
        target = load_target(args.target_model, need_norm=corpus.final_slot == "pre-norm")
        if target.hidden != corpus.hidden:
            raise UserError(f"--target-model {args.target_model} has hidden size {target.hidden} but the data's is "
                            f"{corpus.hidden}: the data comes from another model")
        final_norm = None
        if corpus.final_slot == "pre-norm":
            eps = float(target.config.get("rms_norm_eps") or 1e-5)
            final_norm = RMSNorm(target.hidden, eps).to(d.device)
            assert target.norm is not None, "load_target(need_norm=True) refuses a target without one"
            with torch.no_grad():
                final_norm.weight.copy_(target.norm)
            final_norm.requires_grad_(False)
        if args.steps is None:  # --epochs (SpecForge's default): the steps its passes over the data take
            epochs = args.epochs if args.epochs is not None else DEFAULT_EPOCHS
            per_rank = max(1, len(batches(corpus.train, budget=args.token_budget, seed=args.seed, epoch=0)) // d.world)
            args.steps = max(1, math.ceil(epochs * per_rank / args.grad_accum))
            if d.rank == 0:
                print(f"train: {epochs:g} epoch(s) of {per_rank} batch(es) per rank, --grad-accum {args.grad_accum}: "
                      f"{args.steps} steps", flush=True)
        model, cfg = build(args, corpus, target, d)
        if args.compile:
            compile_draft(model)
        source = (f"the final hidden state ({corpus.final_slot}) through the target's LM head"
                  if corpus.layers == 4 else f"the stored top-{corpus.topk} logprobs")
        if d.rank == 0:
            covered = int(model.t2d.sum())
            print(f"train: {len(corpus.train)} train / {len(corpus.val)} validation samples, hidden {corpus.hidden}; "
                  f"target from {source}; draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size} "
                  f"({covered} ids)" + (f"; {len(corpus.bad)} bad file(s) skipped" if corpus.bad else ""), flush=True)
            mass = target_mass(corpus.train, model.t2d.cpu()) if corpus.topk else None
            if mass:
                print(f"train: the targets hold {100 * mass[0]:.1f} % of the target's probability in the stored "
                      f"top-{corpus.topk} and {100 * mass[1]:.1f} % within the draft vocabulary (renormalised to "
                      "100 %)" + (f"; WARNING: below {100 * MASS_WARN:.0f} %, the target is sharper than the model's "
                                 "own distribution: extract with a larger --target-topk" if mass[0] < MASS_WARN else ""),
                      flush=True)
            if corpus.cut:
                print(f"train: {corpus.cut} sample(s) longer than --max-length {args.max_length} tokens cut to it",
                      flush=True)
            print(f"train: draft layer: {cfg.num_attention_heads} heads × {cfg.head_dim}, {cfg.num_key_value_heads} "
                  f"KV heads, MLP {cfg.intermediate_size} ({draft_shape(args, target.config, target.hidden)[1]}); "
                  f"RoPE θ {cfg.rope_theta:g}" + (f", {cfg.rope_scaling}" if cfg.rope_scaling else ""), flush=True)
        # fused AdamW on a GPU (one kernel for all parameters); the CPU keeps the reference loop
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0,
                                fused=True if d.device.type == "cuda" else None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args))
        origin = {"run": os.environ.get(RUN_ENV) or None, "data": corpus.identity}
        start = _resume_point(args, out, d, model, opt, sched, cfg, origin)
        # Buffers (the frozen target embedding, d2t, t2d) are identical on every rank by construction:
        # broadcasting them each step would move the whole embedding (4.7 GB at V = 163,840, H = 7,168).
        # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still broadcasts them once at
        # init: the old flag stays (its own advice until `init_sync_buffers` exists), without its warning in
        # every rank's log.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if d.world > 1 else model
        ctx = Ctx(target=target, head=TargetHead(frozen(target.head, d.device), model), final_norm=final_norm, cfg=cfg,
                  origin=origin)
        return _loop(args, d, ddp, model, opt, sched, corpus, ctx, start, out)
    finally:
        d.close()


def _check_args(args) -> None:
    """Flag combinations refused before anything is read; --max-length's default filled in."""
    if args.steps is not None and args.epochs is not None:
        raise UserError("give --steps or --epochs, not both")
    if args.steps is not None and args.steps < 1 or args.epochs is not None and args.epochs <= 0:
        raise UserError("--steps must be at least 1 and --epochs above 0")
    if args.max_length is None:
        args.max_length = min(DEFAULT_MAX_LENGTH, args.token_budget)
    for flag, value, low in (("--max-length", args.max_length, 2), ("--grad-accum", args.grad_accum, 1),
                             ("--token-budget", args.token_budget, 2), ("--workers", args.workers or 0, 0)):
        if value < low:
            raise UserError(f"{flag} {value}: must be at least {low}")
    if args.max_length > args.token_budget:
        raise UserError(f"--max-length {args.max_length} is more than --token-budget {args.token_budget}: a sample that "
                        "long would be a batch past the budget's memory; lower --max-length or raise --token-budget")
    if not 0 <= args.warmup_ratio < 1:
        raise UserError(f"--warmup-ratio {args.warmup_ratio}: must be at least 0 and below 1")


def lr_factor(args):
    """The learning rate's factor at optimizer step s (0-based): linear warm-up over --warmup-ratio of --steps,
    then cosine decay to 0 at --steps (or constant)."""
    warmup = max(1, math.ceil(args.warmup_ratio * args.steps))
    decay = max(1, args.steps - warmup)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if args.schedule == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (s - warmup) / decay)))  # > 0 at the last step

    return factor


def _resume_point(args, out: Path, d: Dist, model, opt, sched, cfg: DraftConfig, origin: dict) -> int:
    """The step to continue from: --out's latest checkpoint when it is this training's; otherwise 0,
    after moving an earlier training's files aside (OUT/previous/<time>/) so no two trainings mix."""
    found = checkpoint.latest_step(out)
    why = "--fresh" if args.fresh else None
    if found is not None and why is None:
        why = checkpoint.shape_problem(out, step=found, config=cfg)
        if why and args.resume:  # asked to resume: a flag mistake, not a new training
            raise checkpoint.resume_refused(why)
        why = why or checkpoint.origin_problem(out, step=found, origin=origin)
    if found is not None and why is None:
        checkpoint.load(out, step=found, model=model, opt=opt, sched=sched, rank=d.rank, config=cfg)
        if d.rank == 0:
            _truncate_progress(out, found)
            print(f"train: resumed from step {found} of {out} (pass --fresh to start over)", flush=True)
        return found
    if d.rank == 0 and (moved := set_aside(out, keep_previous=args.keep_previous)) is not None:
        print(f"train: {why or 'no checkpoint to resume'}: moved the earlier training's files to {moved}; "
              "starting at step 1", flush=True)
    d.barrier()
    return 0


@dataclass
class Ctx:
    """What every step reads besides the batch."""

    target: Target
    head: TargetHead  # the target's LM head on the device, its draft rows gathered once
    final_norm: RMSNorm | None
    cfg: DraftConfig
    origin: dict  # the run and the data, recorded in each checkpoint
    disk_need: int | None = None  # bytes the checkpoints still to come will add at their peak (from the last save)
    disk_warned: bool = False


def train_step(ddp, model, opt, sched, feed, head: TargetHead, final_norm, *, ttt: int, grad_accum: int,
               max_grad_norm: float, device: torch.device):
    """One optimizer step over the next `grad_accum` batches of `feed`, without waiting for the device.

    Returns (summed loss and entropy as device tensors, real tokens, files --skip-bad left out)."""
    opt.zero_grad(set_to_none=True)
    loss_sum = ent_sum = torch.zeros((), device=device)
    tokens, bad = 0, []
    for micro in range(grad_accum):
        host, skipped = next(feed)
        bad += skipped
        tokens += int(host["mask"].sum())  # counted on the host copy: no device read
        batch = to_device(host, device)
        tgt = build_target(batch, model, head, final_norm)
        # gradients are all-reduced once per optimizer step, on its last batch
        last = micro == grad_accum - 1
        sync = ddp.no_sync() if ddp is not model and not last else contextlib.nullcontext()
        with sync:
            with _autocast(device):
                loss, ent, _ = ddp(batch, tgt, steps=ttt)
            (loss / grad_accum).backward()
        loss_sum, ent_sum = loss_sum + loss.detach(), ent_sum + ent
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    sched.step()
    return loss_sum, ent_sum, tokens, bad


def _workers(args, device: torch.device) -> int:
    return args.workers if args.workers is not None else (4 if device.type == "cuda" else 0)


def _autocast(device: torch.device):
    """bf16 autocast on a GPU; float32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _loop(args, d: Dist, ddp, model, opt, sched, corpus: Corpus, ctx: Ctx, start: int, out: Path) -> int:
    """The steps. Nothing in a step waits for the device except at a read: the steps that log, save, validate or
    end read the loss (one all-reduce), check it is finite and measure tokens/s over the steps since the last."""
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    progress = open(out / "progress.jsonl", "a") if d.rank == 0 else None  # noqa: SIM115
    bad: list[str] = []
    plan = EpochBatches(corpus.train, budget=args.token_budget, seed=args.seed, world=d.world, rank=d.rank)
    stream = loader(BatchStream(plan, start * args.grad_accum + 1, args.steps * args.grad_accum,
                                skip_bad=args.skip_bad), workers=_workers(args, d.device), pin=d.device.type == "cuda")
    feed = iter(stream)
    step = start
    since, tokens = time.perf_counter(), 0
    try:
        for step in range(start + 1, args.steps + 1):
            loss_sum, ent_sum, n, skipped = train_step(ddp, model, opt, sched, feed, ctx.head, ctx.final_norm,
                                                      ttt=args.ttt, grad_accum=args.grad_accum,
                                                      max_grad_norm=args.max_grad_norm, device=d.device)
            tokens += n
            bad += skipped
            evaluating = bool(args.eval_every) and step % args.eval_every == 0
            saving = step % args.save_every == 0 or step == args.steps or evaluating
            stopping = d.any(stop["flag"])
            if step % args.log_every == 0 or saving or evaluating or stopping:
                mloss, ment, mtok = d.mean([loss_sum / args.grad_accum, ent_sum / args.grad_accum, tokens])
                rate = mtok * d.world / (time.perf_counter() - since)
                since, tokens = time.perf_counter(), 0
                if not math.isfinite(mloss) or mloss > 1e4:
                    _write(progress, {"step": step, "total_steps": args.steps, "loss": None, "kl": None,
                                      "tokens_per_s": rate, "error": f"loss is {mloss} at step {step}"})
                    raise TrainError(f"training stopped: loss is {mloss} at step {step} (NaN or exploding); "
                                     "lower --lr or check the data; the next start resumes from the last checkpoint")
                _write(progress, {"step": step, "total_steps": args.steps,
                                  **({"run": ctx.origin["run"]} if ctx.origin.get("run") else {}),
                                  "loss": round(mloss, 6),
                                  "kl": round(mloss - ment, 6), "tokens_per_s": round(rate, 1),
                                  "lr": float(f"{sched.get_last_lr()[0]:.6g}"),
                                  **({"disk_need_bytes": ctx.disk_need} if ctx.disk_need is not None else {})})
            if evaluating and d.rank == 0:
                _validation(out, step, model, corpus, ctx, args, d)
            if stopping:
                _save(out, step, model, opt, sched, ctx, args, d)
                if d.rank == 0:
                    print(f"train: SIGTERM: checkpoint saved at step {step}; the next start resumes from it "
                          "(`eagle3 start train`, or the same command)", flush=True)
                return 0
            if saving and step != args.steps:
                _save(out, step, model, opt, sched, ctx, args, d)
        _save(out, step, model, opt, sched, ctx, args, d)
        if d.rank == 0:
            if not (args.eval_every and step % args.eval_every == 0):  # not validated at this step already
                _validation(out, step, model, corpus, ctx, args, d)
                prune(out, keep_last=args.keep_last)  # the best by validation may have changed
            if bad:
                print(f"train: {len(bad)} unreadable file(s) skipped (--skip-bad)", flush=True)
            _export(out, step, ctx)
        return 0
    finally:
        del feed  # ends the loader's workers
        if progress:
            progress.close()


def _save(out: Path, step: int, model, opt, sched, ctx: Ctx, args, d: Dist) -> None:
    """A checkpoint at `step`; then (rank 0) the ones beyond --keep-last and the best by validation go, and what
    the kept ones and the draft will still need is measured again (a shortfall is warned once)."""
    checkpoint.save(out, step=step, model=model, opt=opt, sched=sched, rank=d.rank, barrier=d.barrier,
                    config=ctx.cfg, origin=ctx.origin)
    if d.rank != 0:
        return
    gone = prune(out, keep_last=args.keep_last)
    if gone:
        print(f"train: checkpoint at step {step} saved; deleted {len(gone)} older one(s) (steps "
              f"{', '.join(map(str, gone))}): --keep-last {args.keep_last} and the best by validation are kept",
              flush=True)
    fit = checkpoint_fit(out, step=step, keep_last=args.keep_last, steps=args.steps, save_every=args.save_every,
                         eval_every=args.eval_every)
    ctx.disk_need = fit.need_bytes  # in the progress lines that follow: the service weighs it against free space
    if fit.problem and not ctx.disk_warned:
        ctx.disk_warned = True
        print(f"train: warning: {fit.problem}", flush=True)


def _validation(out: Path, step: int, model, corpus, ctx: Ctx, args, d: Dist) -> None:
    v = validate(model, corpus, ctx.head, ctx.final_norm, args, d.device)
    with open(out / "validation.jsonl", "a") as fh:
        fh.write(json.dumps({"step": step, **v}) + "\n")
    acc = ", ".join("-" if a is None else f"{a:.3f}" for a in v["acc"])
    print(f"train: step {step} validation top-1 by position [{acc}], most-frequent baseline {v['baseline_top1']:.3f}",
          flush=True)


def _export(out: Path, step: int, ctx: Ctx) -> None:
    dest = export_checkpoint(checkpoint.step_dir(out, step), (out / "draft").resolve())
    print(f"train: draft for SGLang written to {dest} (LlamaForCausalLMEagle3); {tp_line(dest)}", flush=True)
    warning = context_warning(dest)
    if warning:
        print(f"train: {warning}", flush=True)
    print(f"train: serve it with: {launch_line(dest, str(Path(ctx.target.source).resolve()))}", flush=True)


def _write(fh, record: dict) -> None:
    if fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def _truncate_progress(out: Path, step: int) -> None:
    """Drop progress lines past the checkpoint we resume from, so steps never repeat."""
    path = out / "progress.jsonl"
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def main(argv: list[str] | None = None, *, prog: str = "python -m pipeline.train", epilog: str | None = None) -> int:
    """Entry point; one-line errors, exit 2 (bad input) or 3 (numerical failure)."""
    args = parser(prog, epilog).parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        if int(os.environ.get("RANK", "0")) == 0 or isinstance(exc, RankDeviceError):
            print(f"train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
