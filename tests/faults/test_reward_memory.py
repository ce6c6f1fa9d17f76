"""A reward over its memory ceiling (issue 25, item 6): ``algorithm.reward_memory_mb`` caps what a
reward worker may allocate while scoring; a sample past it scores 0, is counted as a ``memory``
failure (reward/failures), its worker is replaced, and the other samples and the pool go on."""

from megarl.rewards import RewardPool, RewardSample

FNS = "tests.unit.reward_fns"


def test_reward_past_its_memory_ceiling_is_a_counted_failure_and_the_pool_goes_on():
    pool = RewardPool(f"{FNS}:memory_hungry", workers=1, timeout_s=30.0, memory_mb=256)
    try:
        before = pool.workers[0].proc.pid
        report = pool.score([RewardSample("small", 0), RewardSample("big", 1024), RewardSample("big", 64),
                             RewardSample("small", 0)])
        after = pool.workers[0].proc.pid
        again = pool.score([RewardSample("small", 0)])
    finally:
        pool.close()
    assert report.scores == [1.0, 0.0, 1.0, 1.0]  # 64 MB fits under 256 MB; 1 GB does not
    assert dict(report.failures) == {"memory": 1} and report.timeouts == 0
    assert "algorithm.reward_memory_mb=256" in report.examples["memory"]
    assert after != before  # the worker that ran out was replaced
    assert again.scores == [1.0] and again.failed == 0


def test_no_ceiling_when_zero():
    pool = RewardPool(f"{FNS}:memory_hungry", workers=1, timeout_s=30.0, memory_mb=0)
    try:
        report = pool.score([RewardSample("big", 300)])
    finally:
        pool.close()
    assert report.scores == [1.0] and report.failed == 0
