"""Validation metrics against brute force: pass@k by enumerating every k-subset of a prompt's
responses, maj@n by counting answers, per data source and overall."""

from __future__ import annotations

import itertools
import random

import pytest

from megarl.trainer.validation import Sample, majority_reward, pass_at_k, summarize


def brute_pass_at_k(correct, k):
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 4, 5, 8])
def test_pass_at_k_is_the_mean_over_every_k_subset(n):
    rng = random.Random(n)
    for _ in range(20):
        correct = [rng.random() < 0.3 for _ in range(n)]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


def test_summary_overall_and_by_source():
    rng = random.Random(0)
    samples = []
    for p in range(6):
        source = "a" if p < 4 else "b"
        for _ in range(4):
            answer = rng.choice(["1", "2", "3"])
            samples.append(Sample(p, source, float(answer == "1"), rng.randint(1, 9), answer, answer))
    m = summarize(samples, 4, majority=True)
    for prefix, rows in (("val/", samples), ("val/a/", samples[:16]), ("val/b/", samples[16:])):
        groups = [rows[i:i + 4] for i in range(0, len(rows), 4)]
        assert m[f"{prefix}reward/mean@4"] == pytest.approx(sum(s.reward for s in rows) / len(rows))
        assert m[f"{prefix}pass@1"] == pytest.approx(sum(sum(s.reward for s in g) / 4 for g in groups) / len(groups))
        assert m[f"{prefix}pass@4"] == pytest.approx(sum(any(s.reward for s in g) for g in groups) / len(groups))
        maj = []
        for g in groups:
            counts = {a: [s.answer for s in g].count(a) for a in "123"}
            top = max(counts.values())
            winner = next(s.answer for s in g if counts[s.answer] == top)
            maj.append(float(winner == "1"))
        assert m[f"{prefix}maj@4"] == pytest.approx(sum(maj) / len(maj))
        assert m[f"{prefix}prompts"] == len(groups)
    assert majority_reward([Sample(0, "", 0.0, 1, "x", None)]) == 0.0  # nothing extracted
