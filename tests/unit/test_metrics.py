"""Metrics reduce as they declare: over sampling rounds (megarl.metrics.merge) and over an
update's optimizer steps in the engine."""

from __future__ import annotations

import torch

from megarl.engines.megatron_engine import MegatronEngine
from megarl.metrics import Metric, Reduce, merge


def test_rounds_merge_by_each_metrics_reduction():
    rounds = [{"a/mean": Metric(1.0), "a/most": Metric(3, Reduce.MAX), "a/calls": Metric(2, Reduce.SUM),
               "a/least": Metric(0.5, Reduce.MIN)},
              {"a/mean": Metric(2.0), "a/most": Metric(5, Reduce.MAX), "a/calls": Metric(4, Reduce.SUM),
               "a/least": Metric(0.25, Reduce.MIN)}]
    assert merge(rounds) == {"a/mean": 1.5, "a/most": 5, "a/calls": 6, "a/least": 0.25}
    assert merge([]) == {}


def test_engine_reduces_update_metrics_as_declared():
    """Two optimizer steps' [loss sum, count, metrics...]: means divide the summed weighted values
    by the total count, whatever a metric is named; extrema and sums reduce as declared."""
    names = ["clip_frac", "spread_max", "ratio_low", "tokens"]
    kinds = [Reduce.MEAN, Reduce.MIN, Reduce.MIN, Reduce.SUM]
    reports = [(torch.tensor([2.0, 4.0, 1.0, 0.5, 0.9, 4.0]), names, kinds),
               (torch.tensor([6.0, 4.0, 3.0, 0.2, 0.7, 4.0]), names, kinds)]
    metrics = MegatronEngine._metrics(reports, [1.0, None])
    assert metrics["loss"] == 1.0 and metrics["skipped_steps"] == 1.0 and metrics["grad_norm"] == 1.0
    assert metrics["clip_frac"] == 0.5 and metrics["tokens"] == 8.0
    assert abs(metrics["spread_max"] - 0.2) < 1e-6 and abs(metrics["ratio_low"] - 0.7) < 1e-6
