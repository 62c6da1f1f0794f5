"""`python -m pipeline.train`: the trainer's entry point and main loop (run under torchrun)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.errors import UserError
from pipeline.train import checkpoint
from pipeline.train.data import Corpus, batches, load_batch, load_corpus
from pipeline.train.model import DraftHead, load_lm_head, target_logprobs


class TrainError(UserError):
    """Training stopped on a numerical failure."""

    exit_code = 3


def parser() -> argparse.ArgumentParser:
    """The trainer's arguments (also `eagle3 train`)."""
    p = argparse.ArgumentParser(prog="python -m pipeline.train", description="Train an EAGLE-3 draft head.")
    p.add_argument("--data", required=True, help="extraction output directory")
    p.add_argument("--lm-head", help="target LM head: a safetensors file or a Hugging Face model directory")
    p.add_argument("--out", required=True, help="checkpoint directory (progress.jsonl goes here)")
    p.add_argument("--steps", type=int, required=True, help="train up to this step")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--skip-bad", action="store_true", help="leave out missing or corrupt sample files (counted)")
    p.add_argument("--ttt", type=int, default=7, help="training-time-test unroll steps (default 7)")
    p.add_argument("--token-budget", type=int, default=4096, help="padded tokens per batch per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0, help="validation every N steps (default: at the end)")
    return p


class Dist:
    """torch.distributed when launched by torchrun; a no-op single process otherwise."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
        if self.world > 1:
            if self.device.type == "cpu":
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # never bind another interface
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def mean(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
            t /= self.world
        return t.tolist()

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            dist.destroy_process_group()


def vocab_size(corpus: Corpus, lm_head) -> int:
    if lm_head is not None:
        return lm_head.shape[0]
    from safetensors.torch import load_file
    top = 0
    for s in corpus.train + corpus.val:
        t = load_file(str(s.path))
        top = max(top, int(t["token_ids"].max()), int(t["target_topk_ids"].max()))
    return top + 1


def validate(model, corpus: Corpus, lm_head, args, device) -> dict:
    """Per-position top-1 accuracy against the target's argmax, and the most-frequent-token baseline."""
    hits, counts, argmaxes = [0] * args.ttt, [0] * args.ttt, Counter()
    model.eval()
    with torch.no_grad():
        for b in batches(corpus.val, budget=args.token_budget, seed=args.seed, epoch=0):
            batch = {k: v.to(device) for k, v in load_batch(b).items()}
            logp, ids = target_logprobs(batch, lm_head)
            _, _, acc = model(batch, logp, ids, ttt=args.ttt)
            for k, (h, n) in enumerate(acc):
                hits[k] += h
                counts[k] += n
            top = logp.argmax(-1) if ids is None else torch.gather(ids, -1, logp.argmax(-1, keepdim=True))[..., 0]
            argmaxes.update(top[batch["mask"]].tolist())
    model.train()
    total = sum(argmaxes.values())
    return {"acc": [h / n if n else None for h, n in zip(hits, counts, strict=True)],
            "baseline_top1": argmaxes.most_common(1)[0][1] / total if total else None}


def run(args: argparse.Namespace) -> int:
    """Load, (resume,) step, save, validate."""
    d = Dist()
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        corpus = load_corpus(Path(args.data), skip_bad=args.skip_bad)
        lm_head = load_lm_head(args.lm_head).to(d.device).float() if args.lm_head else None
        if corpus.layers == 4 and lm_head is None:
            raise UserError("the files carry the final layer: pass --lm-head (the target's LM head) to form the target")
        if lm_head is not None and lm_head.shape[1] != corpus.hidden:
            raise UserError(f"--lm-head is [{lm_head.shape[0]}, {lm_head.shape[1]}] but the data's hidden size is "
                            f"{corpus.hidden}: the head is from another model")
        source = "final hidden state through the frozen LM head" if corpus.layers == 4 else f"stored top-{corpus.topk} logprobs"
        if d.rank == 0:
            print(f"train: {len(corpus.train)} train / {len(corpus.val)} validation samples, hidden {corpus.hidden}; "
                  f"target from the {source}" + (f"; {len(corpus.bad)} bad file(s) skipped" if corpus.bad else ""),
                  flush=True)
        torch.manual_seed(args.seed)
        model = DraftHead(hidden=corpus.hidden, vocab=vocab_size(corpus, lm_head), lm_head=lm_head).to(d.device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        start = 0
        if args.resume and (found := checkpoint.latest_step(out)) is not None:
            checkpoint.load(out, step=found, model=model, opt=opt, sched=sched, rank=d.rank)
            start = found
            if d.rank == 0:
                _truncate_progress(out, start)
                print(f"train: resumed from step {start}", flush=True)
        ddp = torch.nn.parallel.DistributedDataParallel(model) if d.world > 1 else model
        return _loop(args, d, ddp, model, opt, sched, corpus, lm_head, start, out)
    finally:
        d.close()


def _loop(args, d: Dist, ddp, model, opt, sched, corpus: Corpus, lm_head, start: int, out: Path) -> int:
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    per_epoch: dict[int, list] = {}
    progress = open(out / "progress.jsonl", "a") if d.rank == 0 else None  # noqa: SIM115
    bad = [] if args.skip_bad else None
    step = start
    try:
        for step in range(start + 1, args.steps + 1):
            batch_list = _rank_batches(per_epoch, corpus, args, d, step)
            t0 = time.perf_counter()
            batch = {k: v.to(d.device) for k, v in load_batch(batch_list, bad=bad).items()}
            logp, ids = target_logprobs(batch, lm_head)
            with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=d.device.type == "cuda"):
                loss, ent, _ = ddp(batch, logp, ids, ttt=args.ttt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tokens = float(batch["mask"].sum())
            mloss, ment, mtok = d.mean([loss.item(), ent.item(), tokens])
            rate = mtok * d.world / (time.perf_counter() - t0)
            if not math.isfinite(mloss) or mloss > 1e4:
                _write(progress, {"step": step, "total_steps": args.steps, "loss": None, "kl": None,
                                  "tokens_per_s": rate, "error": f"loss is {mloss} at step {step}"})
                raise TrainError(f"training stopped: loss is {mloss} at step {step} (NaN or exploding); "
                                 "lower --lr or check the data, then --resume from the last checkpoint")
            if step % args.log_every == 0 or step == args.steps:
                _write(progress, {"step": step, "total_steps": args.steps, "loss": round(mloss, 6),
                                  "kl": round(mloss - ment, 6), "tokens_per_s": round(rate, 1)})
            if args.eval_every and step % args.eval_every == 0 and d.rank == 0:
                _validation(out, step, model, corpus, lm_head, args, d)
            if d.any(stop["flag"]):
                checkpoint.save(out, step=step, model=model, opt=opt, sched=sched, rank=d.rank, barrier=d.barrier)
                if d.rank == 0:
                    print(f"train: SIGTERM: checkpoint saved at step {step}; resume with --resume", flush=True)
                return 0
            if step % args.save_every == 0 and step != args.steps:
                checkpoint.save(out, step=step, model=model, opt=opt, sched=sched, rank=d.rank, barrier=d.barrier)
        checkpoint.save(out, step=step, model=model, opt=opt, sched=sched, rank=d.rank, barrier=d.barrier)
        if d.rank == 0:
            _validation(out, step, model, corpus, lm_head, args, d)
            if bad:
                print(f"train: {len(bad)} unreadable file(s) skipped (--skip-bad)", flush=True)
        return 0
    finally:
        if progress:
            progress.close()


def _rank_batches(cache: dict, corpus: Corpus, args, d: Dist, step: int) -> list:
    """This rank's batch for `step`: a pure function of (seed, step), so resume is exact."""
    every = batches(corpus.train, budget=args.token_budget, seed=args.seed, epoch=0)
    per_rank = max(1, len(every) // d.world)
    epoch, i = divmod(step - 1, per_rank)
    if epoch not in cache:
        cache.clear()
        cache[epoch] = batches(corpus.train, budget=args.token_budget, seed=args.seed, epoch=epoch)
    all_batches = cache[epoch]
    return all_batches[(i * d.world + d.rank) % len(all_batches)]


def _validation(out: Path, step: int, model, corpus, lm_head, args, d: Dist) -> None:
    v = validate(model, corpus, lm_head, args, d.device)
    with open(out / "validation.jsonl", "a") as fh:
        fh.write(json.dumps({"step": step, **v}) + "\n")
    acc = ", ".join("-" if a is None else f"{a:.3f}" for a in v["acc"])
    print(f"train: step {step} validation top-1 by position [{acc}], most-frequent baseline {v['baseline_top1']:.3f}",
          flush=True)


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


def main(argv: list[str] | None = None) -> int:
    """Entry point; one-line errors, exit 2 (bad input) or 3 (numerical failure)."""
    args = parser().parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
