"""The ETA's latency path: each sample's request latency gives the cost's shape (issue 14)."""

from __future__ import annotations

import math
import sqlite3

import pytest

from pipeline.manifest import SCHEMA, Manifest, summarize
from pipeline.observe.eta import EtaEstimator
from pipeline.observe.latency import LatencyMoments, LatencyProfile, length_bin
from pipeline.toy.etabench import eta_errors
from pipeline.toy.simtrace import Scenario, simulate


def test_length_bins_are_powers_of_two():
    assert [length_bin(n) for n in (1, 2, 3, 700, 1024, 1025)] == [1, 2, 2, 512, 1024, 1024]


def test_the_manifest_profile_is_the_sum_of_its_samples(tmp_path):
    samples = [(16, 0.4), (700, 0.9), (700, 1.1), (1500, 2.0), (9000, 14.0)]
    m = Manifest(tmp_path)
    m.set_meta({"samples_total": 7, "tokens_total": 20000})
    for i, (n, lat) in enumerate(samples):
        m.record(idx=i, sample_id=None, status="done", tokens=n, nbytes=1, attempts=1, error=None, now=1.0,
                 latency_s=lat)
    m.record(idx=5, sample_id=None, status="failed", tokens=50, nbytes=None, attempts=3, error="x", now=1.0)
    m.record(idx=6, sample_id=None, status="done", tokens=60, nbytes=1, attempts=1, error=None, now=1.0)  # untimed
    m.close()
    got = LatencyProfile.from_bins(summarize(tmp_path)["latency_bins"])
    want = LatencyProfile()
    for n, lat in samples:
        want += LatencyProfile.one(n, lat)
    assert sorted(got.bins) == [16, 512, 1024, 8192]
    for k, mom in want.bins.items():
        assert got.bins[k].values() == pytest.approx(mom.values(), rel=1e-12)


def test_a_manifest_from_before_latencies_reads_as_unknown_then_gains_the_column(tmp_path):
    conn = sqlite3.connect(tmp_path / "manifest.sqlite")
    conn.executescript(SCHEMA.replace(", latency_s REAL", ""))
    conn.execute("INSERT INTO samples (idx, status, tokens) VALUES (0, 'done', 10)")
    conn.commit()
    conn.close()
    assert summarize(tmp_path)["latency_bins"] is None  # unknown, not zero
    Manifest(tmp_path).close()  # the writer (a resumed run) adds the column and keeps the rows
    assert summarize(tmp_path)["done"] == 1 and summarize(tmp_path)["latency_bins"] is None


@pytest.mark.parametrize("bad", [None, [], {"512": {"samples": 1}}, {"x": LatencyMoments.one(5, 1.0).to_json()},
                                 {"512": {**LatencyMoments.one(5, 1.0).to_json(), "sum_s": "nan"}}])
def test_malformed_moments_are_unknown(bad):
    assert LatencyProfile.from_json(bad) is None


def test_on_length_bucketed_data_the_latency_shape_holds_at_a_quarter():
    """Issue 14's hardest case: 8 ascending length buckets, a strong quadratic term. With each sample's
    latency the estimate is within 10 % at 25 %. From span sums alone (two length levels seen) the
    curvature is not known: the band spans every fit the sums cannot tell apart, and holds the truth."""
    sc = Scenario("eta", samples=18000, order="bucketed", per_token2_s=1.5e-7, seed=0)
    with_latency = eta_errors(simulate(sc))
    assert with_latency["eagle3"][25] is not None and with_latency["eagle3"][25] <= 0.10, with_latency["eagle3"]
    assert with_latency["band"][25] == 1.0
    without = eta_errors(simulate(Scenario(**{**sc.__dict__, "with_latency": False})))
    assert without["eagle3"][25] is not None and without["band"][25] == 1.0, without


def test_far_longer_prompts_than_any_timed_withhold_the_latency_estimate():
    est = EtaEstimator()
    for k in range(1, 40):  # 10 prompts of 500 tokens every 30 s, each timed at 3 s
        prof = LatencyProfile()
        for _ in range(10):
            prof += LatencyProfile.one(500 + (k % 7) * 20, 3.0)
        est.add(t=30.0 * k, dt=30.0, samples=10, tokens=5000, tokens_sq=10 * 500 ** 2, latency=prof)
    near = est.estimate(samples_left=100, tokens_left=60_000, tokens_sq_left=100 * 600 ** 2)
    assert near is not None and near.low_s <= near.eta_s <= near.high_s and 200 < near.eta_s < 450, near
    far = est.estimate(samples_left=100, tokens_left=300_000, tokens_sq_left=100 * 3000 ** 2)
    assert far is None and "longer than those timed so far" in est.why, est.why
    assert math.isfinite(est.shape.timed_rms())
