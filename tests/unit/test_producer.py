"""The asynchronous loop's producer (megarl/trainer/producer.py) with a rollout that records its
calls: batches in order within the staleness bound, and a draw that fails while the trainer waits
for the lock ends the weight sync at once (the split one-step-off case of a stopped rollout rank:
no second collective with the broken ranks, no second hang deadline)."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.trainer.producer import Producer


class Rollout:
    def __init__(self, fail_at=None, hold=None):
        self.calls = []
        self.fail_at, self.hold = fail_at, hold  # step whose generate fails; an Event it waits on first

    def generate(self, prompts, sampling):
        self.calls.append(("generate", prompts))
        if prompts == self.fail_at:
            if self.hold is not None:
                assert self.hold.wait(10)
            raise RuntimeError(f"rollout rank 1 made no progress (step {prompts})")
        return prompts


def draw(step, rollout, phase):
    with phase("generate"):
        return rollout.generate(step, None)


@pytest.mark.parametrize("threaded", [True, False])
def test_batches_in_order_within_the_bound(threaded):
    rollout = Rollout()
    producer = Producer(draw, rollout, start=1, last=5, bound=1, threaded=threaded)
    try:
        for step in range(1, 6):
            sampled, seconds = producer.take(step)
            assert sampled == step and "generate" in seconds
            # at most `bound` versions ahead: batch s needs the rollout at version s - 2
            drawn = [p for _, p in rollout.calls]
            assert max(drawn) <= step + 1, (step, drawn)
            producer.sync(lambda: rollout.calls.append(("sync", step)) or {}, step)
    finally:
        producer.stop()
    assert [p for kind, p in rollout.calls if kind == "generate"] == [1, 2, 3, 4, 5]


def test_a_draw_failing_while_the_sync_waits_ends_the_sync_without_running_it():
    hold = threading.Event()
    rollout = Rollout(fail_at=3, hold=hold)
    producer = Producer(draw, rollout, start=1, last=5, bound=1, threaded=True)
    try:
        assert producer.take(1)[0] == 1
        producer.sync(lambda: {}, 1)  # batch 3 may now be drawn: its generate holds the lock
        assert producer.take(2)[0] == 2
        deadline = time.monotonic() + 10
        while ("generate", 3) not in rollout.calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ran = []
        threading.Timer(0.3, hold.set).start()  # the generate fails while the sync waits for the lock
        with pytest.raises(RuntimeError, match=r"rollout rank 1 made no progress \(step 3\)"):
            producer.sync(lambda: ran.append(2) or {}, 2)
        assert ran == []
        with pytest.raises(RuntimeError, match=r"step 3"):
            producer.take(3)
    finally:
        producer.stop()


def test_take_raises_when_the_drawing_thread_is_gone():
    producer = Producer(draw, Rollout(), start=1, last=1, bound=1, threaded=True)
    assert producer.take(1)[0] == 1
    producer.thread.join(5)
    with pytest.raises(RuntimeError, match="drawing thread ended without handing over the batch of step 2"):
        producer.take(2)
