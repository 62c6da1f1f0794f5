"""Each verdict on recorded (simulated) histories, the incident, and the ETA targets."""

import math
import random

import pytest

from pipeline.observe.diagnosis import Diagnoser, diagnose
from pipeline.toy.etabench import eta_errors
from pipeline.toy.simtrace import Scenario, simulate, standard_scenarios
from pipeline.verdict import Policy

SCENARIOS = {sc.name: sc for sc in standard_scenarios()}


def verdicts(trace):
    d = Diagnoser(stage=trace.scenario.stage)
    return [d.feed(o) for o in trace.observations]


def first(vs, verdict):
    return next((v for v in vs if v.verdict == verdict), None)


@pytest.mark.parametrize("name", ["healthy-idle-gpus", "sorted-lengths", "giant-prompts", "checkpoint-pauses"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_runs_never_alarm_and_end_done(name, seed):
    sc = SCENARIOS[name]
    trace = simulate(Scenario(**{**sc.__dict__, "seed": seed}))
    vs = verdicts(trace)
    assert {v.verdict for v in vs[:-1]} <= {"starting", "progressing"}, {v.verdict for v in vs}
    assert vs[-1].verdict == "done"


def test_giant_prompt_gap_is_held_off_by_evidence_not_ignored():
    vs = verdicts(simulate(SCENARIOS["giant-prompts"]))
    held = [v for v in vs if v.reasons and "but it is working" in v.reasons[0]]
    assert held, "giant prompts should pass the learned deadline and be held off by evidence"
    assert any("busy at" in v.reasons[0] for v in held)


@pytest.mark.parametrize("name", ["server-hang", "client-deadlock"])
def test_real_stall_detected_within_5_minutes(name):
    trace = simulate(SCENARIOS[name])
    vs = verdicts(trace)
    stalled = first(vs, "stalled")
    assert stalled is not None and stalled.stuck
    assert stalled.t - stalled.last_progress_at <= 300
    assert all(v.verdict == "progressing" for v in vs if v.t < stalled.t)
    assert stalled.eta_s is None


def test_server_hang_evidence_names_health_and_gpus():
    stalled = first(verdicts(simulate(SCENARIOS["server-hang"])), "stalled")
    text = " ".join(stalled.reasons)
    assert "server health failing" in text and "pinned at 100 % at low power" in text
    assert "CPU time flat" in text and "nothing written" in text


def test_crash_is_dead_at_first_tick():
    trace = simulate(SCENARIOS["client-crash"])
    vs = verdicts(trace)
    assert vs[-1].verdict == "dead" and vs[-1].stuck
    assert vs[-1].reasons == ("killed by signal 9",)
    assert vs[-2].verdict == "progressing"


def test_exit0_early_is_dead_with_percentage():
    v = verdicts(simulate(SCENARIOS["exit0-early"]))[-1]
    assert v.verdict == "dead"
    assert v.reasons[0].startswith("exited early at 9")


def test_slow_disk_reported_within_15_minutes():
    sc = SCENARIOS["slow-disk"]
    vs = verdicts(simulate(sc))
    slow = first(vs, "slow")
    t0 = vs[0].t - sc.tick_s
    assert slow is not None and slow.t - t0 - sc.slow_from_s <= 900
    assert all(v.verdict == "progressing" for v in vs if v.t < slow.t)


def base(t, **kw):
    return {"t": t, "stage": "extract", **kw}


def test_too_many_failures_is_dead():
    v = diagnose([base(1, process={"alive": False, "exit_code": 0},
                       progress={"done": 988, "failed": 12, "total": 1000})])
    assert v.verdict == "dead"
    assert v.reasons == ("1.2 % of samples failed, above the 0.1 % maximum",)


def test_done_within_failed_share():
    v = diagnose([base(1, process={"alive": False, "exit_code": 0}, progress={"done": 9999, "failed": 1, "total": 10000})])
    assert v.verdict == "done" and v.progress_pct == 100.0


def test_requested_stop_is_stopped_not_dead_whatever_the_code():
    v = diagnose([base(1, stage="server", process={"alive": False, "exit_code": 137, "stop_requested": True})])
    assert v.verdict == "stopped" and not v.stuck


def test_vanished_process_is_dead():
    v = diagnose([base(1, process={"alive": False, "exit_code": None})])
    assert v.verdict == "dead" and "vanished" in v.reasons[0]


def test_starting_then_stall_without_any_progress():
    hist = [base(t, process={"alive": True, "cpu_s": 1.0}, progress={"done": 0, "failed": 0, "total": 10})
            for t in range(0, 1000, 10)]
    vs = [Diagnoser(stage="extract").feed(h) for h in hist[:1]]
    assert vs[0].verdict == "starting"
    v = diagnose(hist, policy=Policy(startup_window_s=600))
    assert v.verdict == "stalled"


def test_all_unknown_is_unknown_never_zero():
    v = diagnose([base(1, process=None, unknown={"process": "stage not started"})])
    assert v.verdict == "unknown" and v.progress_pct is None and "stage not started" in v.reasons[0]


def test_gpu_idleness_alone_is_not_a_stall():
    # Progress keeps coming while every GPU reads 0 % — the incident's healthy state.
    hist = [base(t, process={"alive": True, "cpu_s": t / 100}, progress={"done": t // 10, "failed": 0, "total": 10_000},
                 gpus=[{"index": i, "util": 0.0, "power_w": 80.0} for i in range(8)]) for t in range(0, 3000, 10)]
    assert diagnose(hist).verdict == "progressing"


def test_server_stage_verdicts():
    up = [base(t, stage="server", process={"alive": True}, server={"healthy": True}) for t in range(0, 100, 10)]
    assert diagnose(up).verdict == "progressing"
    down = up + [base(100 + t, stage="server", process={"alive": True}, server={"healthy": False})
                 for t in range(0, 400, 10)]
    v = diagnose(down)
    assert v.verdict == "stalled" and "health check failing" in v.reasons[0]


def test_the_incident_replayed():
    """37,312 samples, GPUs idle, server counter ahead, file listing timed out: alive, 49 %, ~4.8 h."""
    trace = simulate(Scenario("incident", samples=37312, seed=11))
    d = Diagnoser(stage="extract")
    t_start = trace.observations[0]["t"] - 10
    verdict = None
    for obs in trace.observations:
        obs["gpus"] = [{"index": i, "util": 0.0, "mem_used_mb": 75000, "power_w": 90.0, "power_limit_w": 700.0}
                       for i in range(8)]
        obs["server"]["requests_total"] = int(obs["progress"]["done"] * 1.215)
        obs["files"] = None
        obs["unknown"] = {"files": "scan exceeded its 5 s budget (filesystem under load?)"}
        verdict = d.feed(obs)
        if obs["progress"]["done"] >= 18424:
            break
    assert verdict.verdict == "progressing" and not verdict.stuck
    assert 49.0 <= verdict.progress_pct <= 50.0
    truth = t_start + trace.finish_s - verdict.t
    assert abs(verdict.eta_s - truth) / truth <= 0.15
    assert verdict.eta_low_s <= verdict.eta_s <= verdict.eta_high_s


@pytest.mark.parametrize("sort", [True, False])
def test_eta_targets(sort):
    errors = eta_errors(simulate(Scenario("eta", samples=6000, sort_by_length=sort, seed=3)))
    limit = 0.10 if sort else 0.03
    for cp in (50, 75):
        assert errors["eagle3"][cp] is not None and errors["eagle3"][cp] <= limit, (cp, errors["eagle3"])
    # Early on a sorted run the fit extrapolates to prompts longer than any seen: the estimate may be
    # withheld (with the reason) or off, but its band must hold the truth. (Issue 14 asks ≤ 10 % at 25 %:
    # not met on every seed; see bench/RESULTS.md.)
    for cp in (10, 25):
        if errors["eagle3"][cp] is not None:
            assert errors["band"][cp] == 1.0, (cp, errors)
            assert sort or errors["eagle3"][cp] <= limit
    if sort:  # the naive estimators miss badly on a sorted workload; that is the point
        assert errors["tqdm-ema"][50] > 0.3 and errors["average-rate"][50] > 0.3


def test_eta_suppressed_early():
    trace = simulate(Scenario("early", samples=3000))
    d = Diagnoser(stage="extract")
    assert d.feed(trace.observations[0]).eta_s is None
    assert not math.isnan(d.deadline())


def test_eta_withheld_while_the_prompts_left_are_far_longer_than_any_seen():
    from pipeline.observe.eta import EtaEstimator

    est = EtaEstimator()
    for k in range(1, 40):  # 10 prompts of 500 tokens every 30 s: cost 3 s each
        est.add(t=30.0 * k, dt=30.0, samples=10, tokens=5000, tokens_sq=10 * 500 ** 2)
    near = est.estimate(samples_left=100, tokens_left=60_000, tokens_sq_left=100 * 600 ** 2)
    assert near is not None and 250 < near.eta_s < 400, near
    far = est.estimate(samples_left=100, tokens_left=300_000, tokens_sq_left=100 * 3000 ** 2)
    assert far is None and "6.0× longer than any seen" in est.why, est.why


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_eta_from_token_counts_alone_holds_on_sorted_superlinear_work(order):
    """Issue 14's held-out case: the observations carry done/total/tokens only (no Σtokens², no latencies)
    and the cost is strongly quadratic. A linear fit on (samples, tokens) missed ascending data by 35–45 %
    with a band that never held the truth; each span's Σtokens² taken as tokens²/samples, and the work
    left's estimated from its mean and the current length, keeps it within 10 % from half way."""
    sc = Scenario("eta", samples=6000, order=order, per_token2_s=1.5e-7, with_sq=False, with_latency=False, seed=3)
    errors = eta_errors(simulate(sc))
    for cp in (50, 75):
        assert errors["eagle3"][cp] is not None and errors["eagle3"][cp] <= 0.10, (cp, errors["eagle3"])
    for cp in (10, 25, 50, 75):
        assert errors["band"][cp] in (None, 1.0), (cp, errors)
    if order == "ascending":
        assert errors["average-rate"][50] > 0.3


@pytest.mark.parametrize("order", ["bucketed", "random-buckets"])
def test_eta_from_token_counts_alone_is_given_from_a_quarter_with_its_band(order):
    """Issue 31: on length-bucketed data with token counts only, the ETA was withheld until 50–75 %
    (the seed's operator asked at 49 %). From a quarter of the work on there is an estimate on every
    seed, and its band holds the truth. On ascending buckets two length levels are seen at 25 %, which a
    line and a parabola fit alike: the estimate is the centre of the fits the spans cannot tell apart
    (it was the noise's pick, 7–48 % off, before), which comes close only where the truth sits near the
    middle of that range: the benchmark's milder and stronger curvatures are 25–43 % off there. On buckets
    in random order the Σtokens² of the work left is the larger unknown; its estimate is the centre between
    as spread as within the spans seen and as spread as the spans seen (issue 31 stays open for its
    accuracy: see bench/RESULTS.md)."""
    for seed in (0, 1):
        sc = Scenario("eta", samples=6000, order=order, per_token2_s=1.5e-7, with_sq=False, with_latency=False,
                      seed=seed)
        errors = eta_errors(simulate(sc))
        for cp in (25, 50, 75):
            assert errors["eagle3"][cp] is not None, (order, seed, cp)
        for cp in (25, 50, 75) if order == "bucketed" else (50, 75):
            assert errors["band"][cp] == 1.0, (order, seed, cp, errors)
        if order == "bucketed":  # issue 31's 15 % at a quarter: 0.2 and 11 % on these seeds (2 and 16 % while the
            # tolerance for fits the spans cannot tell apart took their estimated Σtokens² as exact)
            assert errors["eagle3"][25] <= 0.15, (seed, errors["eagle3"])


def test_the_band_holds_every_curvature_the_spans_allow_at_each_bound_of_the_work_left():
    """On token counts alone, at a quarter of buckets in random order, both the cost's curvature (few lengths
    seen) and the Σtokens² of the buckets to come are unknown; the band's bounds take every fit the spans
    cannot tell apart at each bound of the Σtokens² (it took the best fit only there, and missed the truth
    on this seed: the estimate 22 % short, the band's top 2 % short; the top is 49 % over it now)."""
    sc = Scenario("eta", samples=6000, order="random-buckets", per_token2_s=1.5e-7, with_sq=False,
                  with_latency=False, seed=3)
    errors = eta_errors(simulate(sc))
    assert errors["eagle3"][25] is not None and errors["band"][25] == 1.0, errors


def test_the_band_allows_lengths_not_seen_yet_where_buckets_come_in_random_order():
    """Buckets of a two-mode mix (chats, long documents) in random order, token counts only: at a quarter the
    spans seen may all be chats while documents are left, a spread (CV² up to 2.2) beyond the CV² of 1 the
    band's top allowed, and the band missed the truth at 25 and 50 % on this seed (2 or 3 of the benchmark's
    5 seeds). Where the spans differ far beyond how prompts within one do, in no order, it allows a CV² of 2."""
    sc = Scenario("eta", samples=6000, order="random-buckets", lengths="mixture", per_token2_s=1.5e-7,
                  with_sq=False, with_latency=False, seed=3)
    errors = eta_errors(simulate(sc))
    assert errors["band"][25] == 1.0 and errors["band"][50] == 1.0, errors


def test_eta_from_token_counts_alone_counts_how_prompts_differ_within_a_span():
    """A span's Σtokens², where the stage reports only token counts, is its intervals' tokens² / samples plus
    how much prompts differ within one interval (from consecutive intervals' mean lengths), not as if its
    prompts were alike: on length buckets of a two-mode mix, the bucket that straddles the modes holds
    prompts from 1,300 to 3,300 tokens, and taken as alike its cost per token² came out high, 23–36 % off at
    three quarters of the run (4 seeds of 6,000 samples; 6–19 % now)."""
    for seed in (0, 2):
        sc = Scenario("eta", samples=6000, order="bucketed", lengths="mixture", per_token2_s=1.5e-7, with_sq=False,
                      with_latency=False, seed=seed)
        errors = eta_errors(simulate(sc))
        assert errors["eagle3"][75] <= 0.12 and errors["band"][75] == 1.0, (seed, errors)


def test_the_cost_range_spans_what_two_length_levels_cannot_tell():
    """Spans at two prompt lengths fit a line and a parabola alike: `predict_range` reaches from the
    linear extrapolation to the steepest non-negative quadratic, and the truth lies inside. With lengths
    spread over many levels the curvature is known and the range closes around the truth."""
    from pipeline.observe.costfit import CostModel

    def cost(n):
        return 0.3 + 2.8e-4 * n + 1.5e-7 * n * n

    rng = random.Random(4)
    for levels, widest in (((500, 1000), 5.0), (tuple(range(500, 8001, 500)), 1.15)):
        model = CostModel(half_life_s=math.inf)
        for i in range(200):
            n = levels[i % len(levels)]
            model.add(t=float(i), dt=20 * cost(n) * rng.lognormvariate(0, 0.05), samples=20, tokens=20 * n,
                      tokens_sq=20 * n * n)
        lo, hi = model.predict_range(samples=100, tokens=100 * 6000, tokens_sq=100 * 6000 ** 2)
        truth = 100 * cost(6000)
        assert lo / 1.02 <= truth <= hi * 1.02 and hi / lo <= widest, (levels, lo / truth, hi / truth)
        if len(levels) == 2:
            linear = 100 * (cost(500) + (cost(1000) - cost(500)) / 500 * (6000 - 500))
            assert lo <= 1.05 * linear and hi / lo > 1.5, (lo / linear, hi / lo)
