"""Diagnosis on simulated traces: detection latency, false alarms, ETA error side by side."""

from __future__ import annotations

import time

from pipeline.observe.diagnosis import Diagnoser
from pipeline.toy.etabench import eta_errors
from pipeline.toy.simtrace import Scenario, simulate, standard_scenarios

SEEDS = range(5)


def _score(sc: Scenario) -> dict:
    alarms, latencies, verdict_at_end = 0, [], set()
    for seed in SEEDS:
        trace = simulate(Scenario(**{**sc.__dict__, "seed": seed}))
        d = Diagnoser(stage=sc.stage)
        t0 = trace.observations[0]["t"] - sc.tick_s
        vs = [d.feed(o) for o in trace.observations]
        fault = trace.fault_at_s
        bad = [v for v in vs if v.verdict in ("stalled", "dead")]
        if fault is None and sc.exit0_at_fraction is None:
            alarms += len(bad)
        elif bad:
            if sc.stall_at_s is not None:
                start = bad[0].last_progress_at or t0
            elif fault is not None:
                start = t0 + fault
            else:  # exit 0 early: from the last observation before the exit
                start = vs[vs.index(bad[0]) - 1].t
            latencies.append(bad[0].t - start)
        verdict_at_end.add(vs[-1].verdict)
    return {"alarms": alarms, "latencies": latencies, "end": "/".join(sorted(verdict_at_end))}


# (order, c, what the observations carry): "latency" = counts, Σtokens² and each sample's latency (today's
# extraction); "sq" = counts and Σtokens²; "tokens" = done/total/tokens only (another stage, an older trace)
ETA_WORKLOADS = [("shuffled", 1.4e-8, "latency"), ("ascending", 1.4e-8, "latency"), ("shuffled", 1.5e-7, "latency"),
                 ("ascending", 1.5e-7, "latency"), ("bucketed", 1.5e-7, "latency"), ("descending", 1.5e-7, "latency"),
                 ("bucketed", 1.5e-7, "sq"), ("shuffled", 1.5e-7, "tokens"), ("ascending", 1.5e-7, "tokens"),
                 ("bucketed", 1.5e-7, "tokens"), ("random-buckets", 1.5e-7, "tokens"), ("descending", 1.5e-7, "tokens"),
                 # issue 31: at 25 % of ascending buckets two length levels are seen, which a line and a parabola
                 # fit alike; the estimate is the centre of the fits the spans cannot tell apart, so how close it
                 # comes depends on where the true curvature lies in that range: the same workload, c milder/stronger
                 ("bucketed", 1.4e-8, "tokens"), ("bucketed", 4e-7, "tokens"),
                 # the same estimator on lengths of another shape (two modes: short chats, long documents), so
                 # that nothing above is true only of the lognormal the simulator draws from
                 ("shuffled", 1.5e-7, "tokens", "mixture"), ("ascending", 1.5e-7, "tokens", "mixture"),
                 ("bucketed", 1.5e-7, "tokens", "mixture"), ("random-buckets", 1.5e-7, "tokens", "mixture")]
CARRIES = {"latency": {}, "sq": {"with_latency": False}, "tokens": {"with_latency": False, "with_sq": False}}


ETA_SAMPLES = 18_000  # the size of issue 14's held-out traces (16,000–20,000 samples)


def _eta_section() -> list[str]:
    lines = ["### ETA error", "", f"Relative error |estimate − truth| / truth at 10/25/50/75 % progress, {ETA_SAMPLES:,} "
             f"samples, mean over the {len(SEEDS)} seeds (worst seed in brackets; how many withheld it, with the "
             "reason shown to the operator); `band` is the share of checkpoints whose band held the truth. "
             "Per-sample cost a + b·tokens + c·tokens² with 15 % lognormal noise: c = 1.4e-8 is the mild case "
             "(the quadratic is ~10 % of a median sample), c = 1.5e-7 the strong one (a sample at the 99th length "
             "percentile costs ~35× one at the 1st; 9× in the mild case). Orders: shuffled, ascending by length, ascending buckets (8) "
             "shuffled inside, descending. `oracle` is a reference no real estimator has: the quadratic fitted to "
             "every finished sample's own duration (weighted by the true noise) and summed over exactly the "
             "samples left; what it misses, the durations seen so far do not tell. "
             "Issue 14's targets: ≤ 10 % at 25/50/75 % on sorted and bucketed, ≤ 3 % shuffled, band ≥ 80 %, "
             "at 10 % within 22 % or withheld. `carries`: what the observations hold — `latency` (counts, Σtokens² and "
             "each sample's request latency, as the extraction reports them), `sq` (counts and Σtokens²), `tokens` "
             "(done, total, tokens only: the span's Σtokens² is then its intervals' tokens²/samples plus how much "
             "prompts differ within one, from consecutive intervals' mean lengths, and the work left's estimated "
             "from its mean and the current length on length-sorted data, or between as spread as within the "
             "spans and as spread as the spans seen on unsorted data). Where the spans cannot tell the cost's curvature (two "
             "or three length levels seen), the estimate is the geometric centre of the non-negative fits they "
             "cannot tell from the best (issue 31), and the band spans them. `random-buckets`: 8 length buckets "
             "in random order, shuffled inside (issue 31's case). Lengths are lognormal (median 1,800 tokens, σ 0.7) "
             "except where the workload says `mixture`: 70 % short chats (median 700, σ 0.5) and 30 % long documents "
             "(median 5,000, σ 0.4).", "",
             "| workload | c | carries | estimator | 10 % | 25 % | 50 % | 75 % |", "|---|---|---|---|---|---|---|---|"]
    for order, c, carries, *shape in ETA_WORKLOADS:
        lengths = shape[0] if shape else "lognormal"
        per = {}
        for seed in SEEDS:
            sc = Scenario("eta", samples=ETA_SAMPLES, order=order, per_token2_s=c, seed=seed, lengths=lengths,
                          **CARRIES[carries])
            for name, cps in eta_errors(simulate(sc)).items():
                for cp, err in cps.items():
                    per.setdefault(name, {}).setdefault(cp, []).append(err)
        for name, cps in per.items():
            cells = []
            for cp in (10, 25, 50, 75):
                errs = [e for e in cps.get(cp, []) if e is not None]
                held = len(cps.get(cp, [])) - len(errs)
                note = f", {held} withheld" if errs and held else ""
                if name == "band":
                    cells.append(f"{100 * sum(errs) / len(errs):.0f} %{note}" if errs else "withheld")
                else:
                    cells.append(f"{100 * sum(errs) / len(errs):.1f} % ({100 * max(errs):.1f}){note}"
                                 if errs else "withheld")
            workload = order if lengths == "lognormal" else f"{order}, {lengths}"
            lines.append(f"| {workload} | {c:g} | {carries} | {name} | " + " | ".join(cells) + " |")
    return lines


def run(*, full: bool = True) -> list[str]:
    lines = ["## Diagnosis on simulated traces (issues 3 and 14)", "",
             f"Each scenario simulated with {len(SEEDS)} seeds, 3,000 samples, 10 s ticks, GPUs idle between requests "
             "(as in the incident). Per-sample cost is a + b·tokens + c·tokens² with lognormal noise; the traces carry "
             "Σtokens² as the extraction does, and the ETA fits the quadratic term from it. Latency for stalls is "
             "measured from the last progress; for crashes and early exits from the fault.", "",
             "| scenario | false alarms (stalled/dead on a healthy run) | detection latency | final verdict |",
             "|---|---|---|---|"]
    for sc in standard_scenarios():
        r = _score(sc)
        lat = (f"{min(r['latencies']):.0f}–{max(r['latencies']):.0f} s" if r["latencies"] else "—")
        lines.append(f"| {sc.name} | {r['alarms']} | {lat} | {r['end']} |")
    slow = standard_scenarios()[4]
    detections = []
    for seed in SEEDS:
        d = Diagnoser(stage="extract")
        trace = simulate(Scenario(**{**slow.__dict__, "seed": seed}))
        t0 = trace.observations[0]["t"] - slow.tick_s
        hit = next((v for v in (d.feed(o) for o in trace.observations) if v.verdict == "slow"), None)
        detections.append(hit.t - t0 - slow.slow_from_s if hit else float("inf"))
    lines += ["", f"Slow disk (5× slower from t = {slow.slow_from_s:.0f} s): reported `slow` after "
              f"{min(detections):.0f}–{max(detections):.0f} s (target ≤ 900 s).", ""]
    lines += _eta_section()
    trace = simulate(Scenario("10h", samples=37312))
    t = time.perf_counter()
    d = Diagnoser(stage="extract")
    for o in trace.observations:
        d.feed(o)
    lines += ["", f"Replay speed: a {len(trace.observations):,}-tick trace (about {len(trace.observations) / 360:.1f} h "
              f"at 10 s ticks) diagnosed in {time.perf_counter() - t:.2f} s.", ""]
    return lines
