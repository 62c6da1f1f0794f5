"""Simulated observation traces with known ground truth, for tests and benchmarks.

A trace is an extraction (or training) run seen at 10 s ticks: per-sample cost
a + b·tokens with noise, optional faults. The GPUs sit idle between requests, as in
the incident: a healthy run must not look stuck because of that.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from pipeline.observe.latency import LatencyProfile

HIDDEN = 7168
LAYERS = 4


@dataclass
class Scenario:
    """What to simulate; times are seconds from the start of the run."""

    name: str
    samples: int = 3000
    seed: int = 0
    sort_by_length: bool = False  # the same as order = "ascending"
    order: str = "shuffled"  # or "ascending", "descending", "bucketed" (ascending buckets, shuffled inside)
    buckets: int = 8
    lengths: str = "lognormal"  # prompt lengths: one lognormal mode, or "mixture" (short chats and long documents)
    with_sq: bool = True  # the observation carries tokens_sq_done / tokens_sq_total (extraction records them)
    # ... and latency_moments: each sample's request latency, which one request at a time (as simulated
    # here) is its duration
    with_latency: bool = True
    overhead_s: float = 0.3  # per request
    per_token_s: float = 2.8e-4
    # Attention makes long prompts cost more than linearly; the ETA model is linear,
    # so this keeps the benchmark from grading the estimator on its own assumption.
    per_token2_s: float = 1.4e-8
    noise: float = 0.15  # lognormal sigma
    tick_s: float = 10.0
    stage: str = "extract"
    giant_every: int = 0  # every Nth sample is a giant prompt
    giant_s: float = 300.0
    # The last seconds of a giant prompt: its prefill is done (GPUs back to 0 %, 90 W) and the client
    # receives and parses the multi-GB answer (half a core per tick) before the file appears.
    parse_tail_s: float = 0.0
    busy_power_w: float = 610.0
    checkpoint_every: int = 0  # training: a checkpoint pause every N steps
    checkpoint_s: float = 300.0
    # ... whose last seconds write nothing (the file's fsync and rename, the ranks' barrier before the next step)
    checkpoint_quiet_s: float = 0.0
    # ... during which rank 0 sleeps in the kernel on the file's fsync (a flush to a network filesystem), which
    # the process probe reads as `process.disk_wait` (members in uninterruptible disk sleep)
    quiet_in_fsync: bool = False
    validate_every: int = 0  # training: validation after every N steps (on rank 0; no step, nothing written)
    validate_s: float = 180.0
    validate_load_s: float = 0.0  # ... whose first seconds load the validation set (a core busy, GPUs idle)
    # training: the GPUs are read (busy at power while steps run; while rank 0 writes a checkpoint or
    # validates, as pipeline/train does, ranks 1–7 wait at the next collective, NCCL's kernels spinning:
    # 100 % at low power)
    train_gpus: bool = False
    # extraction: the server's answers arrive in bursts of this many samples (a continuous-batching server
    # finishing a batch of long prompts together); GPUs busy while a burst is pending, quiet for its last
    # parse_tail_s while the client receives and parses the answers
    burst: int = 0
    slow_from_s: float | None = None
    slow_factor: float = 5.0
    stall_at_s: float | None = None
    # "server-hang": the server stops answering health checks; "server-wedged": health passes and the
    # requests stay "running" but none completes, GPUs idle (a stuck collective, a wedged scheduler);
    # "client-deadlock": the client stops sending; "filesystem-hang": the client blocks writing a file to a
    # filesystem that stopped answering (in uninterruptible disk sleep from then on).
    stall_kind: str = "server-hang"
    crash_at_s: float | None = None
    exit0_at_fraction: float | None = None
    fail_share: float = 0.0
    end_extra_ticks: int = 3
    extra: dict = field(default_factory=dict)


@dataclass
class Trace:
    """Observations plus the ground truth needed to score a diagnosis."""

    scenario: Scenario
    observations: list[dict]
    finish_s: float  # when the last sample finished (inf if never)
    fault_at_s: float | None
    work: list[tuple[int, float]] = field(default_factory=list)  # each sample's (tokens, seconds), in order


def _lengths(sc: Scenario, rng: random.Random) -> list[int]:
    if sc.lengths == "mixture":  # a data mix: 70 % short chats, 30 % long documents (two lognormal modes)
        lengths = [max(16, int(rng.lognormvariate(math.log(700), 0.5) if rng.random() < 0.7
                               else rng.lognormvariate(math.log(5000), 0.4))) for _ in range(sc.samples)]
    else:
        lengths = [max(16, int(rng.lognormvariate(math.log(1800), 0.7))) for _ in range(sc.samples)]
    order = "ascending" if sc.sort_by_length else sc.order
    if order in ("ascending", "descending"):
        return sorted(lengths, reverse=order == "descending")
    if order in ("bucketed", "random-buckets"):  # buckets of similar length, ascending or in random order
        ranked, size = sorted(lengths), -(-len(lengths) // sc.buckets)
        buckets = [ranked[i:i + size] for i in range(0, len(ranked), size)]
        if order == "random-buckets":
            rng.shuffle(buckets)
        out = []
        for bucket in buckets:
            rng.shuffle(bucket)
            out += bucket
        return out
    return lengths


def _durations(sc: Scenario, lengths: list[int], rng: random.Random) -> list[tuple[float, str]]:
    """Each sample's (seconds, kind): kind is "" for an ordinary sample, else "giant", "checkpoint" or
    "validate" (the step whose end waits for a checkpoint write or a validation pass)."""
    out, t = [], 0.0
    for i, n in enumerate(lengths):
        d = (sc.overhead_s + sc.per_token_s * n + sc.per_token2_s * n * n) * rng.lognormvariate(0, sc.noise)
        giant = bool(sc.giant_every and i % sc.giant_every == sc.giant_every - 1)
        pause = bool(sc.checkpoint_every and i % sc.checkpoint_every == sc.checkpoint_every - 1)
        validate = bool(sc.validate_every and i % sc.validate_every == sc.validate_every - 1)
        if giant:
            d = sc.giant_s * rng.uniform(0.8, 1.2)
        if pause:
            d += sc.checkpoint_s
        if validate:
            d += sc.validate_s
        if sc.slow_from_s is not None and t >= sc.slow_from_s:
            d *= sc.slow_factor
        out.append((d, "giant" if giant else "checkpoint" if pause else "validate" if validate else ""))
        t += d
    return out


def simulate(sc: Scenario) -> Trace:
    """Run the scenario and return its observations at each tick."""
    rng = random.Random(sc.seed)
    lengths = _lengths(sc, rng)
    durs = _durations(sc, lengths, rng)
    ends = list(itertools.accumulate(d for d, _ in durs))
    for g in range(0, len(ends), sc.burst) if sc.burst else ():  # a burst's samples complete with its last
        last = min(g + sc.burst, len(ends)) - 1
        ends[g:last] = [ends[last]] * (last - g)
    fault = sc.stall_at_s if sc.stall_at_s is not None else sc.crash_at_s
    exit0_at = ends[int(sc.exit0_at_fraction * sc.samples) - 1] + 1 if sc.exit0_at_fraction else None
    if fault is not None:
        ends = [e if e <= fault else math.inf for e in ends]
    finish = ends[-1]
    stop_t = min(x for x in (finish, fault, exit0_at, math.inf) if x is not None)
    horizon = (stop_t if math.isfinite(stop_t) else ends[-1]) + sc.end_extra_ticks * sc.tick_s
    if fault is not None:
        horizon = fault + 3600.0
    obs: list[dict] = []
    i_done, cpu, written, tok_done, sq_done, moments = 0, 0.0, 0.0, 0, 0, LatencyProfile()
    tokens_total, sq_total = sum(lengths), sum(n * n for n in lengths)
    t0 = 1_790_000_000.0
    for k in itertools.count(1):
        t = k * sc.tick_s
        if t > horizon:
            break
        prev = i_done
        while i_done < sc.samples and ends[i_done] <= t:
            tok_done += lengths[i_done]
            sq_done += lengths[i_done] ** 2
            moments += LatencyProfile.one(lengths[i_done], durs[i_done][0])
            i_done += 1
        requesting = i_done < sc.samples and ends[i_done] != math.inf
        kind = durs[i_done][1] if requesting else ""
        # A giant prompt, or any request over 30 s, keeps the GPUs busy while it runs; so does a burst.
        in_flight = requesting and (bool(sc.burst) or kind != "" or durs[i_done][0] > 30)
        parsing = in_flight and (bool(sc.burst) or kind == "giant") and ends[i_done] - t < sc.parse_tail_s
        stalled = fault is not None and t >= fault and sc.stall_at_s is not None
        crashed = sc.crash_at_s is not None and t >= sc.crash_at_s
        exited0 = exit0_at is not None and t >= exit0_at
        finished = i_done >= sc.samples and not crashed
        cpu += 0.04 * (i_done - prev) + (0.0 if stalled or in_flight else 0.01 * sc.tick_s)
        cpu += 0.5 * sc.tick_s if parsing and not stalled else 0.0
        loading = kind == "validate" and 0 <= t - (ends[i_done] - sc.validate_s) < sc.validate_load_s
        cpu += 1.0 * sc.tick_s if loading else 0.0
        new_bytes = float(sum(lengths[j] for j in range(prev, i_done)) * LAYERS * HIDDEN * 2)
        flushing = False
        if in_flight and sc.stage == "train" and kind != "validate":
            if ends[i_done] - t >= sc.checkpoint_quiet_s:
                new_bytes += 2e8  # a checkpoint being written
            else:
                flushing = kind == "checkpoint" and sc.quiet_in_fsync
        written += new_bytes
        failed = int(i_done * sc.fail_share)
        o: dict[str, Any] = {"t": t0 + t, "stage": sc.stage,
             "process": {"alive": not (crashed or exited0 or finished), "cpu_s": round(cpu, 2),
                         "exit_code": -9 if crashed else (0 if (exited0 or finished) else None),
                         "disk_wait": int(flushing or (stalled and sc.stall_kind == "filesystem-hang"))},
             "progress": {"done": i_done - failed, "failed": failed, "total": sc.samples,
                          "tokens_done": tok_done, "tokens_total": tokens_total, "unit": "samples",
                          "tokens_sq_done": sq_done if sc.with_sq else None,
                          "tokens_sq_total": sq_total if sc.with_sq else None},
             "files": {"count": i_done - failed, "bytes": written}}
        if sc.stage == "extract":
            if sc.with_latency:
                o["progress"]["latency_moments"] = moments.to_json()
            hang = stalled and sc.stall_kind == "server-hang"
            wedged = stalled and sc.stall_kind == "server-wedged"
            busy = in_flight and not stalled and not parsing
            util, power = (100.0, 95.0) if hang else ((97.0, sc.busy_power_w) if busy else (0.0, 90.0))
            o["gpus"] = [{"index": g, "util": util, "mem_used_mb": 75000, "power_w": power, "power_limit_w": 700.0}
                         for g in range(8)]
            o["server"] = {"healthy": not (hang and fault is not None and t >= fault + 20),
                           "running_reqs": 32 if wedged else (1 if ((requesting and not stalled) or hang) else 0),
                           "queue_reqs": 0, "requests_total": int(i_done * 1.2 + k)}
        if sc.stage == "train" and sc.train_gpus:  # rank 0 writes the checkpoint or validates; the others wait
            idle, working, spin = {"util": 0.0, "power_w": 90.0}, {"util": 97.0, "power_w": sc.busy_power_w}, \
                {"util": 100.0, "power_w": 95.0}
            rank0 = idle if kind == "checkpoint" or loading else working
            o["gpus"] = [{"index": g, "mem_used_mb": 60000, "power_limit_w": 700.0,
                          **(rank0 if g == 0 else spin if kind in ("checkpoint", "validate") else working)}
                         for g in range(8)]
        obs.append(o)
        if o["process"]["alive"] is False:
            break
    return Trace(sc, obs, finish if math.isfinite(finish) else math.inf, fault,
                 [(n, d) for n, (d, _) in zip(lengths, durs, strict=True)])


def standard_scenarios(samples: int = 3000) -> list[Scenario]:
    """The benchmark's set: healthy variants and each fault."""
    return [
        Scenario("healthy-idle-gpus", samples=samples),
        Scenario("sorted-lengths", samples=samples, sort_by_length=True, seed=1),
        Scenario("giant-prompts", samples=samples, giant_every=400, giant_s=300, seed=2),
        Scenario("checkpoint-pauses", samples=samples, stage="train", overhead_s=0.8, per_token_s=0.0,
                 checkpoint_every=500, checkpoint_s=360, seed=3),
        Scenario("slow-disk", samples=samples, slow_from_s=1500, seed=4),
        # a giant prompt: 4–7 min prefills at 640 W, then 20 s of the client parsing the answer, GPUs quiet
        Scenario("giant-prefill-parse", samples=samples, giant_every=400, giant_s=330, parse_tail_s=20,
                 busy_power_w=640.0, seed=10),
        # the other quiet transitions of a healthy run: answers in bursts of 256 (about 4.5 min apart), each ending with 20 s of
        # GPUs quiet while the client parses; training whose validation passes (rank 0) start with 90 s of
        # loading the validation set (a core busy, its GPU idle); training whose checkpoint writes end with
        # 40 s in which nothing is written. Ranks 1–7 spin at the next collective through both.
        Scenario("answer-bursts", samples=samples, burst=256, parse_tail_s=20, busy_power_w=640.0, seed=11),
        Scenario("validation-pauses", samples=samples, stage="train", overhead_s=0.8, per_token_s=0.0,
                 validate_every=500, validate_s=240, validate_load_s=90, train_gpus=True, seed=12),
        Scenario("checkpoint-write-end", samples=samples, stage="train", overhead_s=0.8, per_token_s=0.0,
                 checkpoint_every=500, checkpoint_s=200, checkpoint_quiet_s=40, train_gpus=True, seed=13),
        # ... and whose checkpoint writes end with 100 s of fsync to a slow network filesystem (rank 0 in
        # uninterruptible disk sleep): a minute or more of quiet at the first checkpoint, before any gap that
        # long has been learned
        Scenario("checkpoint-slow-flush", samples=samples, stage="train", overhead_s=0.8, per_token_s=0.0,
                 checkpoint_every=500, checkpoint_s=200, checkpoint_quiet_s=100, quiet_in_fsync=True,
                 train_gpus=True, seed=14),
        Scenario("server-hang", samples=samples, stall_at_s=1200, seed=5),
        Scenario("client-deadlock", samples=samples, stall_at_s=1200, stall_kind="client-deadlock", seed=6),
        Scenario("server-wedged", samples=samples, stall_at_s=1200, stall_kind="server-wedged", seed=9),
        Scenario("filesystem-hang", samples=samples, stall_at_s=1200, stall_kind="filesystem-hang", seed=15),
        Scenario("client-crash", samples=samples, crash_at_s=1200, seed=7),
        Scenario("exit0-early", samples=samples, exit0_at_fraction=0.9, seed=8),
    ]
