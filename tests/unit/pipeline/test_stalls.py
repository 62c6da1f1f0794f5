"""Stalls within 90 s of the last progress, a wedged server included; no false alarm on the healthy cases."""

import pytest

from pipeline.observe.diagnosis import Diagnoser
from pipeline.toy.simtrace import Scenario, simulate, standard_scenarios
from pipeline.verdict import Policy

SCENARIOS = {sc.name: sc for sc in standard_scenarios()}


def verdicts(trace):
    d = Diagnoser(stage=trace.scenario.stage)
    return [d.feed(o) for o in trace.observations]


@pytest.mark.parametrize("name", ["server-hang", "client-deadlock", "server-wedged"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_hang_is_flagged_within_90_s_of_the_last_progress(name, seed):
    vs = verdicts(simulate(Scenario(**{**SCENARIOS[name].__dict__, "seed": seed})))
    stalled = next(v for v in vs if v.verdict == "stalled")
    assert stalled.t - stalled.last_progress_at <= 90, stalled.reasons
    assert all(v.verdict in ("starting", "progressing") for v in vs if v.t < stalled.t)


def test_requests_running_on_a_healthy_server_are_not_work_while_nothing_completes():
    """A wedged SGLang (a stuck collective, a wedged scheduler) answers /health and shows its requests
    'running'; with the GPUs idle, nothing written and no CPU, that is a hang."""
    vs = verdicts(simulate(SCENARIOS["server-wedged"]))
    stalled = next(v for v in vs if v.verdict == "stalled")
    text = " ".join(stalled.reasons)
    assert "32 request(s) 'running' on a healthy server but none completed" in text and "GPUs idle" in text
    assert "but it is working" not in text


@pytest.mark.parametrize("name", ["giant-prompts", "checkpoint-pauses", "slow-disk", "healthy-idle-gpus",
                                  "sorted-lengths", "giant-prefill-parse", "answer-bursts", "validation-pauses",
                                  "checkpoint-write-end", "checkpoint-slow-flush"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_no_false_alarm_with_the_shorter_floor(name, seed):
    vs = verdicts(simulate(Scenario(**{**SCENARIOS[name].__dict__, "seed": seed})))
    assert not [v for v in vs if v.verdict in ("stalled", "dead")], name


@pytest.mark.parametrize(("name", "held_by"), [
    ("answer-bursts", "busy at 640 W 10s ago"),  # the GPUs went quiet as a burst's answers came back
    ("validation-pauses", "CPU busy (100 % of a core)"),  # rank 0 loads the validation set, ranks 1–7 spin
    ("checkpoint-write-end", "MB written in the last"),  # the write has ended, ranks 1–7 spin at the barrier
])
def test_the_quiet_after_work_is_held_off_by_that_work(name, held_by):
    """Issue 31's other transitions, each past the learned deadline with nothing counted: the work just
    before holds the stall off (the scenarios' no-false-alarm runs above would pass on a scenario that
    never reached its deadline; this shows each one does)."""
    vs = verdicts(simulate(SCENARIOS[name]))
    held = [v for v in vs if v.reasons and "but it is working" in v.reasons[0] and held_by in v.reasons[0]]
    assert held, name


def test_a_slow_flush_after_the_first_checkpoint_is_waiting_on_the_disk_not_a_hang():
    """100 s of fsync after the first checkpoint write (a network filesystem): nothing written, rank 0 idle,
    ranks 1–7 spinning at the next collective — a collective hang by every other reading, and called
    `stalled` for five ticks before the process probe read uninterruptible disk sleep (here: the same
    trace with `disk_wait` dropped)."""
    trace = simulate(SCENARIOS["checkpoint-slow-flush"])
    vs = verdicts(trace)
    assert not [v for v in vs if v.verdict in ("stalled", "dead")]
    held = [v for v in vs if v.reasons and "but it is working: 1 process(es) waiting on the disk" in v.reasons[0]]
    assert held and "MB written" not in held[0].reasons[0], held[:1]  # the disk wait alone holds it off
    blind = Diagnoser(stage="train")
    for o in trace.observations:
        blind_v = blind.feed({**o, "process": {k: v for k, v in o["process"].items() if k != "disk_wait"}})
        if blind_v.verdict == "stalled":
            assert "collective hang?" in " ".join(blind_v.reasons)
            break
    else:
        raise AssertionError("without the disk-wait reading the quiet reads as a hang; the scenario lost its point")


def test_uninterruptible_sleep_without_a_write_is_no_sign_of_work():
    """A client stuck in uninterruptible sleep with nothing written since its last sample (a filesystem that
    stopped answering, or a driver: a GPU fallen off the bus leaves its processes so) is a hang at the
    usual deadline; the reason names the sleep."""
    vs = verdicts(simulate(SCENARIOS["filesystem-hang"]))
    stalled = next(v for v in vs if v.verdict == "stalled")
    assert stalled.t - stalled.last_progress_at <= 90, stalled.reasons
    assert "1 process(es) in uninterruptible sleep with nothing written since the last progress" in \
        " ".join(stalled.reasons), stalled.reasons
    assert all(v.verdict in ("starting", "progressing") for v in vs if v.t < stalled.t)


def test_gpus_that_could_be_read_and_cannot_now_are_named_in_the_stall():
    """A GPU that falls off the bus fails every NVML read (the probe's reading is unknown, with NVML's words);
    a stall then says so, where the GPUs had been read before (not on a host without NVML)."""
    import copy

    obs = copy.deepcopy(simulate(SCENARIOS["client-deadlock"]).observations)
    for o in obs:
        if o["t"] - obs[0]["t"] >= 1200:
            o.pop("gpus")
            o["unknown"] = {"gpus": "NVML read failed: GPU is lost"}
    d = Diagnoser(stage="extract")
    stalled = next(v for v in (d.feed(o) for o in obs) if v.verdict == "stalled")
    assert "the GPUs were read earlier and cannot be now (NVML read failed: GPU is lost)" in " ".join(stalled.reasons)
    d = Diagnoser(stage="extract")
    never = [d.feed({**{k: v for k, v in o.items() if k != "gpus"}, "unknown": {"gpus": "NVML not available"}})
             for o in obs]
    assert not any("were read earlier" in " ".join(v.reasons) for v in never)


def test_a_flush_that_never_ends_is_a_hung_filesystem_once_a_flush_would_have_ended():
    """After a write, uninterruptible sleep is a flush for up to Policy.disk_wait_s with nothing written;
    a checkpoint's fsync that goes on past it is a stall, and the reason says where it waits."""
    sc = SCENARIOS["checkpoint-slow-flush"]
    trace = simulate(Scenario(**{**sc.__dict__, "checkpoint_s": 800.0, "checkpoint_quiet_s": 600.0}))  # 200 s of writing
    d = Diagnoser(stage="train")
    for o in trace.observations:
        v = d.feed(o)
        if v.verdict == "stalled":
            break
    else:
        raise AssertionError("a 10-minute fsync was never flagged")
    assert Policy().disk_wait_s < v.t - d.last_write_at <= Policy().disk_wait_s + 10, (v.t, d.last_write_at)
    assert "past the 5m00s a flush may take: a hung filesystem?" in " ".join(v.reasons), v.reasons


def test_a_giant_prompt_is_work_while_the_gpus_are_busy():
    vs = verdicts(simulate(SCENARIOS["giant-prompts"]))
    assert any(v.reasons and "but it is working" in v.reasons[0] and "busy at" in v.reasons[0] for v in vs)


def test_a_write_seen_just_after_the_last_progress_does_not_hold_a_hang_off():
    """A scan that lags a tick (or a last flush) shows bytes growing once after the last sample: the
    hang must still be flagged a few ticks after the floor, not held off for the whole activity window."""
    import copy

    trace = simulate(SCENARIOS["server-wedged"])
    obs = copy.deepcopy(trace.observations)
    done = [(o.get("progress") or {}).get("done") for o in obs]
    last = max(i for i in range(1, len(obs)) if done[i] is not None and done[i] != done[i - 1])
    for o in obs[: last + 1]:
        o["files"] = {**o["files"], "bytes": o["files"]["bytes"] - 4096}  # the last file shows up one tick late
    d = Diagnoser(stage=trace.scenario.stage, policy=Policy(stall_floor_s=20))  # a floor below the 60-s activity window
    vs = [d.feed(o) for o in obs]
    stalled = next(v for v in vs if v.verdict == "stalled")
    assert stalled.t - stalled.last_progress_at <= stalled.deadline_s + 3 * trace.scenario.tick_s, stalled.reasons


def giant_prefill_trace() -> list[dict]:
    """Issue 31's shape: a healthy extraction (a sample finishes every tick), then one giant prompt: 8 GPUs
    at 97 % and 640 W for 4 minutes with nothing finished or written and the client's CPU flat; then the
    GPUs quiet (0 %, 90 W) while the client receives and parses the 2.5 GB answer (its CPU rises 5 s per
    10-s tick) for 20 s; then the file."""
    obs, t, cpu, done, written = [], 1_790_000_000.0, 10.0, 0, 0.0

    def tick(util: float, power: float, *, cpu_add: float, finished: int, nbytes: float) -> None:
        nonlocal t, cpu, done, written
        t, cpu, done, written = t + 10, cpu + cpu_add, done + finished, written + nbytes
        obs.append({"t": t, "stage": "extract", "process": {"alive": True, "exit_code": None, "cpu_s": cpu},
                    "progress": {"done": done, "failed": 0, "total": 1000, "tokens_done": done * 2000,
                                 "tokens_total": 2_000_000, "unit": "samples"},
                    "files": {"count": done, "bytes": written},
                    "gpus": [{"index": g, "util": util, "mem_used_mb": 75000, "power_w": power,
                              "power_limit_w": 700.0} for g in range(8)],
                    "server": {"healthy": True, "running_reqs": 1, "queue_reqs": 0, "requests_total": len(obs)}})

    for _ in range(60):  # ten healthy minutes
        tick(35.0, 300.0, cpu_add=0.5, finished=1, nbytes=60e6)
    for _ in range(24):  # the giant prefill
        tick(97.0, 640.0, cpu_add=0.0, finished=0, nbytes=0.0)
    for _ in range(2):  # the answer arrives and is parsed: GPUs quiet, client CPU busy
        tick(0.0, 90.0, cpu_add=5.0, finished=0, nbytes=0.0)
    tick(0.0, 90.0, cpu_add=1.0, finished=1, nbytes=2.5e9)  # the file
    for _ in range(6):
        tick(35.0, 300.0, cpu_add=0.5, finished=1, nbytes=60e6)
    return obs


def test_the_end_of_a_giant_prefill_is_no_stall_through_the_replay_contract(tmp_path, capsys):
    """The tick after the GPUs go quiet used to read 'stalled: no progress for 4m00s … CPU time flat …
    nothing written': the GPUs busy 10 s before counted for nothing, and the client's CPU burst was
    averaged over the whole window. Replayed as `eagle3 diagnose --replay FILE --json` does."""
    import json

    from bot.cli import main

    trace = tmp_path / "giant.jsonl"
    trace.write_text("".join(json.dumps(o) + "\n" for o in giant_prefill_trace()))
    assert main(["diagnose", "--replay", str(trace), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == len(giant_prefill_trace())
    assert [x for x in lines if x["verdict"] in ("stalled", "dead") or x["stuck"]] == []
    quiet = lines[84]  # the first tick with the GPUs quiet
    assert quiet["verdict"] == "progressing" and "busy at 640 W 10s ago" in quiet["reasons"][0], quiet
    assert "CPU busy in the last 10s" in lines[85]["reasons"][0], lines[85]


def test_a_server_wedged_after_a_busy_prefill_is_still_flagged_within_90_s():
    """The GPUs' recent busy tick holds a stall off for one or two ticks only: GPUs that stay quiet with
    nothing parsed (no CPU), nothing written and no progress are a hang at the floor."""
    obs = giant_prefill_trace()[:85]  # up to the first quiet tick, then nothing more happens
    t, cpu = obs[-1]["t"], obs[-1]["process"]["cpu_s"]
    for k in range(1, 13):
        obs.append({**obs[-1], "t": t + 10 * k, "process": {"alive": True, "exit_code": None, "cpu_s": cpu}})
    d = Diagnoser(stage="extract", policy=Policy(stall_floor_s=60))
    vs = [d.feed(o) for o in obs]
    quiet_since = obs[84]["t"] - 10  # the GPUs' last busy tick
    stalled = next(v for v in vs if v.verdict == "stalled")
    assert stalled.t - quiet_since <= 40, (stalled.t - quiet_since, stalled.reasons)


def _tick(t: float, done: int, cpu: float, *, working: bool) -> dict:
    return {"t": t, "stage": "extract", "process": {"alive": True, "exit_code": None, "cpu_s": cpu},
            "progress": {"done": done, "failed": 0, "total": 10_000, "unit": "samples"},
            "gpus": [{"index": 0, "util": 90.0 if working else 0.0, "mem_used_mb": 70_000,
                      "power_w": 600.0 if working else 90.0}],
            "server": {"healthy": True, "running_reqs": 4, "queue_reqs": 0, "requests_total": done * 3}}


def test_a_stall_that_comes_back_is_flagged_again_as_fast_as_the_first():
    """Early in a run the server wedges for 5 minutes, recovers by itself, and wedges again 4 minutes later. The
    first stall's silence is not learned as a normal gap (with it the deadline became 3 × 5 min, and the second
    stall went unflagged for 15 minutes): both are flagged within 90 s of their last progress, and the deadline
    after the recovery is the one from before the stall."""
    d, vs, done, cpu = Diagnoser(stage="extract"), [], 0, 0.0
    spans = [(0, 300, True), (300, 600, False), (600, 840, True), (840, 1740, False), (1740, 1800, True)]
    for start, end, working in spans:
        for t in range(start, end, 10):
            if working and t >= 30:
                done, cpu = done + 1, cpu + 8.0
            vs.append(d.feed(_tick(1_790_000_000.0 + t, done, cpu, working=working)))
    stalls = [v for v in vs if v.verdict == "stalled"]
    first = next(v for v in stalls if v.last_progress_at - 1_790_000_000.0 < 300)
    second = next((v for v in stalls if v.last_progress_at - 1_790_000_000.0 >= 830), None)
    assert first.t - first.last_progress_at <= 90, first.reasons
    assert second is not None, "the second stall was never flagged"
    assert second.t - second.last_progress_at <= 90, second.reasons
    before = next(v for v in reversed(vs) if v.t - 1_790_000_000.0 < 300)
    after = next(v for v in vs if v.t - 1_790_000_000.0 >= 700)
    assert after.deadline_s == before.deadline_s, "the stall's silence was not learned as a gap"
