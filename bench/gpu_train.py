"""The trainer at real shapes on a GPU (issue 33): tokens/s, share of the bf16 peak, peak memory, time by phase.

    python -m bench.gpu_train [--shape llama-3.1-8b kimi-k2] [--steps 20] [--token-budget 8192] [--ttt 7]

Makes its own synthetic extraction data (bf16 hidden states, `--files` sample files of `--length` tokens, in
`--dir` or a temporary directory) and a random target embedding and LM head, then drives the trainer's own
pieces: the loader (`data.loader`, `--workers` processes, pinned memory), `loop.train_step` (target, unrolled
forward, backward, clipping, fused AdamW) under bf16 autocast. Prints one JSON line per shape:

- tokens_per_s over `--steps` steps after `--warmup` (the device synchronised at both ends only);
- flops_per_token, the analytic count: 3 × the forward's matmuls (fc, the decoder layer and lm_head per
  unrolled step, causal attention at the sample length) plus the target (draft rows and the full-vocabulary
  argmax, forward only); share_of_peak against --peak-tflops (default 790, issue 33's figure);
- peak_gb: the allocator's peak over the run;
- phases: the share of a step per phase, measured on separate steps with the device synchronised between
  phases (loading measured in this process, as if no worker prefetched);
- single_sample: the peak memory of one step on one `--single-length`-token sample.

`--shape tiny` runs the same on the CPU in seconds (the suite does, so this file cannot rot); its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-3.1-8B's own attention and MLP (the trainer's default draft for it)
    "llama-3.1-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    # the Kimi-K2 measurement: 64 heads × 128 (64 KV heads, SpecForge's kimi-k25-eagle3.json), MLP 18,432
    "kimi-k2": dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, vocab=163840),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512),
}


def flops_per_token(s: dict, *, draft_vocab: int, ttt: int, length: int) -> float:
    """Analytic training FLOPs per token (see the module docstring)."""
    H, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer = 2 * (2 * H * q + 2 * 2 * H * kv + q * H + 3 * H * s["intermediate"] + H * draft_vocab)
    attention = 2 * 2 * q * (length / 2)  # QKᵀ and PV over the causal half, per token
    forward = 2 * 3 * H * H + ttt * (layer + attention)
    target = 2 * H * draft_vocab + 2 * H * s["vocab"]
    return 3 * forward + target


def _data(root: Path, s: dict, *, files: int, length: int, seed: int):
    """`files` synthetic samples: hidden_states [length, 4, H] bf16 (3 aux + final), token ids."""
    from safetensors.torch import save_file

    from pipeline.train.data import SampleInfo

    g = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(files):
        path = root / f"sample_{i:04d}.safetensors"
        if not path.exists():
            save_file({"token_ids": torch.randint(0, s["vocab"], (length,), generator=g),
                       "hidden_states": torch.randn(length, 4, s["hidden"], generator=g).to(torch.bfloat16)},
                      str(path))
        out.append(SampleInfo(i, path, length))
    return out


def _model(s: dict, *, draft_vocab: int, device: torch.device, seed: int, compiled: bool = False):
    from pipeline.train.model import DraftConfig, Eagle3Draft, TargetHead, frozen
    from pipeline.train.model import draft_vocab as choose

    g = torch.Generator().manual_seed(seed)
    cfg = DraftConfig(hidden_size=s["hidden"], target_hidden_size=s["hidden"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate_size=s["intermediate"],
                      vocab_size=s["vocab"], draft_vocab_size=draft_vocab, rope_theta=500000.0,
                      max_position_embeddings=131072)
    embed = frozen(torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02, device)
    head = frozen(torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02, device)
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg, embed)
    model.set_vocab(*choose(torch.randint(0, 1000, (s["vocab"],), generator=g), draft_vocab))
    model = model.to(device)
    if compiled:
        from pipeline.train.loop import compile_draft

        compile_draft(model)
    return model, TargetHead(head, model)


def _optimizer(model, device: torch.device):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0,
                            fused=True if device.type == "cuda" else None)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _feed(samples, a, *, first: int, last: int, workers: int, device: torch.device):
    from pipeline.train.data import BatchStream, EpochBatches, loader

    plan = EpochBatches(samples, budget=a.token_budget, seed=0, world=1, rank=0)
    return iter(loader(BatchStream(plan, first, last, skip_bad=False), workers=workers, pin=device.type == "cuda"))


def _throughput(model, head, samples, a, device) -> dict:
    from pipeline.train.loop import train_step

    opt, sched = _optimizer(model, device)
    feed = _feed(samples, a, first=1, last=a.warmup + a.steps, workers=a.workers, device=device)
    kw = dict(ttt=a.ttt, grad_accum=1, max_grad_norm=0.5, device=device)
    for _ in range(a.warmup):
        train_step(model, model, opt, sched, feed, head, None, **kw)
    _sync(device)
    t, tokens = time.perf_counter(), 0
    for _ in range(a.steps):
        loss, _, n, _ = train_step(model, model, opt, sched, feed, head, None, **kw)
        tokens += n
    _sync(device)
    elapsed = time.perf_counter() - t
    return {"tokens_per_s": tokens / elapsed, "step_s": elapsed / a.steps, "loss": float(loss)}


def _phases(model, head, samples, a, device) -> dict:
    """Each phase of a step timed alone, the device synchronised between them."""
    from pipeline.train.data import EpochBatches, load_batch, to_device
    from pipeline.train.loop import _autocast
    from pipeline.train.model import build_target

    opt, _ = _optimizer(model, device)
    plan = EpochBatches(samples, budget=a.token_budget, seed=0, world=1, rank=0)
    spent = dict.fromkeys(("load", "host_to_device", "target", "forward", "backward", "optimizer"), 0.0)
    marks: list[float] = []

    def mark():
        _sync(device)
        marks.append(time.perf_counter())

    for number in range(1, a.profile_steps + 1):
        marks[:] = [time.perf_counter()]

        host = load_batch(plan(number))
        if device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        mark()
        batch = to_device(host, device)
        mark()
        tgt = build_target(batch, model, head, None)
        mark()
        with _autocast(device):
            loss, _, _ = model(batch, tgt, steps=a.ttt)
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()
        for name, t0, t1 in zip(spent, marks, marks[1:], strict=False):  # len(marks) = phases + 1
            spent[name] += t1 - t0
    total = sum(spent.values())
    return {k: round(v / total, 3) for k, v in spent.items()}


def _single(s, a, device, root: Path) -> dict:
    """Peak memory of one step on one sample of --single-length tokens."""
    from pipeline.train.loop import train_step

    samples = _data(root / "single", s, files=1, length=a.single_length, seed=1)
    model, head = _model(s, draft_vocab=a.draft_vocab, device=device, seed=1, compiled=a.compile)
    opt, sched = _optimizer(model, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    a1 = argparse.Namespace(**{**vars(a), "token_budget": a.single_length})
    feed = _feed(samples, a1, first=1, last=1, workers=0, device=device)
    train_step(model, model, opt, sched, feed, head, None, ttt=a.ttt, grad_accum=1, max_grad_norm=0.5, device=device)
    _sync(device)
    return {"tokens": a.single_length, "peak_gb": _peak_gb(device)}


def measure(shape: str, a, root: Path) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and shape != "tiny" else "cpu")
    s = SHAPES[shape]
    a = argparse.Namespace(**{**vars(a), "draft_vocab": min(a.draft_vocab, s["vocab"] // 2)})
    samples = _data(root / shape, s, files=a.files, length=a.length, seed=0)
    model, head = _model(s, draft_vocab=a.draft_vocab, device=device, seed=0, compiled=a.compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = {"shape": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "token_budget": a.token_budget, "length": a.length, "ttt": a.ttt, "draft_vocab": a.draft_vocab,
              "workers": a.workers, "compile": a.compile, **_throughput(model, head, samples, a, device)}
    flops = flops_per_token(s, draft_vocab=a.draft_vocab, ttt=a.ttt, length=a.length)
    result.update(flops_per_token=flops, tflops=result["tokens_per_s"] * flops / 1e12,
                  share_of_peak=result["tokens_per_s"] * flops / (a.peak_tflops * 1e12), peak_gb=_peak_gb(device),
                  phases=_phases(model, head, samples, a, device))
    del model, head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["single_sample"] = _single(s, a, device, root / shape)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["llama-3.1-8b", "kimi-k2"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--length", type=int, default=2048, help="tokens per synthetic sample (default 2048)")
    p.add_argument("--single-length", type=int, default=8192)
    p.add_argument("--files", type=int, default=32, help="synthetic sample files (cycled; default 32)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the device's bf16 peak the share is taken of (default 790, the figure issue 33 measured "
                        "against; an H200's datasheet says 989 dense)")
    p.add_argument("--compile", action="store_true", help="the trainer's --compile (loop.compile_draft)")
    p.add_argument("--dir", type=Path, help="where the synthetic data goes (default: a temporary directory)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for shape in a.shape:
            print(json.dumps(measure(shape, a, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
