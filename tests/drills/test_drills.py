"""The reliability drills in CI (few trials; `make drills` runs more and records the counts)."""

from __future__ import annotations

import pytest

from tests.support import drill_harness as harness

pytestmark = pytest.mark.slow


def assert_clean(tally: harness.Tally) -> None:
    assert tally.trials > 0 and tally.faults > 0, tally
    assert not tally.problems, "\n".join(tally.problems)
    assert tally.sample_duplicates == 0


@pytest.mark.timeout(400)
def test_kill_9_of_serve_during_extraction_and_handoff(tmp_path):
    """Once, with the stand-in trainer: the handoff to the real 2-process torchrun is test_demo's
    (`make drills` runs 20 trials in a row, the first with the real trainer, other seeds and kill points)."""
    tally = harness.kill9_serve(tmp_path, trials=1, real_trainer_trials=0, seed=1)
    assert_clean(tally)
    assert tally.messages_delivered > 0 and tally.message_duplicates <= tally.faults


@pytest.mark.timeout(300)
def test_server_crash_mid_extraction(tmp_path):
    tally = harness.server_crash(tmp_path, trials=1)
    assert_clean(tally)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not harness.can_mount(), reason="needs root to mount a small tmpfs (injected ENOSPC is "
                                                    "covered in tests/integration/test_extract.py)")
def test_disk_full_mid_run(tmp_path):
    tally = harness.disk_full(tmp_path, trials=1)
    assert_clean(tally)


@pytest.mark.timeout(120)
def test_slack_500_for_a_minute(tmp_path):
    tally = harness.slack_outage(tmp_path, trials=2)
    assert_clean(tally)
    assert tally.message_duplicates == 0 and tally.messages_delivered > 20


@pytest.mark.timeout(300)
def test_corrupt_store(tmp_path):
    assert_clean(harness.corrupt_store(tmp_path))
