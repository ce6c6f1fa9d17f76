"""A reward with I/O latency for benchmarks/async.py: the built-in digit-reversal verifier behind
a wait, as a remote verifier or sandbox would answer (``MEGARL_BENCH_REWARD_LATENCY_S`` per
sample, spent sleeping, not computing)."""

from __future__ import annotations

import os
import time

from megarl.tasks.reverse_digits import reverse_digits_reward


def remote_reverse_digits(response: str, answer) -> float:
    time.sleep(float(os.environ.get("MEGARL_BENCH_REWARD_LATENCY_S", "0")))
    return reverse_digits_reward(response, answer)
