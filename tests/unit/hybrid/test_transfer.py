"""Split placement's weight-sync plan: every rollout rank receives exactly its generation shard,
once, each range from a training rank that holds it, within the bucket limit, and the rollout's
replicas draw on different training replicas."""

from __future__ import annotations

from collections import defaultdict

import pytest

from megarl.hybrid.transfer import plan_transfer
from megarl.parallel import Layout
from tests.unit.hybrid.test_planner import MODELS, assert_covers_once, max_bucket_load

TRAIN = [Layout(tp=2), Layout(dp=2), Layout(tp=2, pp=2), Layout(pp=2, dp=2), Layout(tp=2, pp=2, vpp=2),
         Layout(tp=4, dp=2), Layout(dp=4, ep=4, etp=1), Layout(tp=2, dp=2, ep=2, etp=1), Layout(tp=2, cp=2)]
GEN = [Layout(tp=1, dp=2), Layout(tp=2, dp=1), Layout(tp=2, dp=2), Layout(tp=4, dp=1), Layout(tp=1, dp=3)]


@pytest.mark.parametrize("name,train,gen", [(n, t, g) for n in MODELS for t in TRAIN for g in GEN
                                            if (MODELS[n].num_experts or t.ep == 1)
                                            and not (MODELS[n].num_experts and g.tp > 1)])
def test_each_rollout_rank_receives_its_shard_once(name, train, gen):
    model = MODELS[name]
    plan = plan_transfer(model, train, gen, bucket_elems=1 << 12)
    segments = [s for b in plan.buckets for s in b]
    assert all(s.src < plan.offset <= s.dst < plan.world_size for s in segments)
    for v in range(gen.world_size):
        covered = defaultdict(list)
        for seg in segments:
            if seg.dst != plan.offset + v:
                continue
            covered[seg.tensor].append((seg.start, seg.stop))
            assert any(lt.spec == seg.tensor and any(p.start <= seg.start and seg.stop <= p.stop for p in lt.pieces)
                       for lt in plan.sources[seg.src]), "a sender that does not hold the range"
        assert_covers_once(covered, plan.shards[v])
        assert plan.received(v) == plan.shard_elems(v)  # the bytes test: exactly the shard
    assert sum(plan.sent(r) for r in range(train.world_size)) == sum(plan.received(v) for v in range(gen.world_size))


def test_buckets_bound_every_rank():
    model, cap = MODELS["tiny-qwen3-moe"], 3000
    plan = plan_transfer(model, Layout(tp=2, dp=2, ep=2, etp=1), Layout(tp=1, dp=2), bucket_elems=cap)
    assert len(plan.buckets) > 5 and max_bucket_load(plan) <= cap


def test_rollout_replicas_read_different_training_replicas():
    model = MODELS["tiny-llama"]
    plan = plan_transfer(model, Layout(tp=2, dp=2), Layout(tp=2, dp=2), bucket_elems=1 << 20)
    senders = {v: {s.src for b in plan.buckets for s in b if s.dst == plan.offset + v} for v in range(4)}
    # rollout replica 0 (ranks 0, 1) reads training replica 0 (ranks 0, 1), each rank its own TP
    # slice; replica 1 reads replica 1 (ranks 2, 3)
    assert senders == {0: {0}, 1: {1}, 2: {2}, 3: {3}}
    whole = plan_transfer(model, Layout(tp=2, dp=2), Layout(tp=1, dp=2), bucket_elems=1 << 20)
    assert {v: {s.src for b in whole.buckets for s in b if s.dst == whole.offset + v} for v in range(2)} == \
        {0: {0, 1}, 1: {2, 3}}
    assert {plan.sent(r) for r in range(4)} == {plan.sent(0)}  # the sending is even


def test_pipelined_rollout_is_refused():
    with pytest.raises(ValueError, match="pp=1"):
        plan_transfer(MODELS["tiny-llama"], Layout(tp=2), Layout(pp=2))
