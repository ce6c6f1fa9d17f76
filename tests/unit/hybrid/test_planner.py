"""The 3D-HybridEngine planner, pure: regrouping (shared/DESIGN.md §3), coverage of every
generation shard, bytes against HybridFlow's formula, buckets, and errors for invalid pairs."""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import pytest

from megarl.hybrid import ModelSpec, ReshardError, TensorSpec, hybridflow_bytes, plan_reshard, rank_traffic, regroup
from megarl.hybrid.shards import Placement
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout

MODELS = {n: ModelSpec.from_args(megatron_args_from_hf(f"configs/models/{n}.json"))
          for n in ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe",
                    "tiny-mixtral", "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-gpt-oss"]}
MOE_MODELS = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-glm4-moe",
              "tiny-gpt-oss"]
BIASED_EXPERTS = {"tiny-gpt-oss"}  # Megatron builds them only with etp=1: no tp > 1 without ep > 1


def split_only(layers: int = 4, hidden: int = 64) -> ModelSpec:
    """A model whose weights are all tensor-parallel and spread evenly over stages: the setting
    of HybridFlow's Table 2."""
    tensors = []
    for layer in range(layers):
        tensors += [TensorSpec(f"decoder.layers.{layer}.a.weight", (4 * hidden, hidden), 0, layer=layer),
                    TensorSpec(f"decoder.layers.{layer}.b.weight", (hidden, 2 * hidden), 1, layer=layer),
                    TensorSpec(f"decoder.layers.{layer}.c.weight", (4 * hidden, hidden), 0, 2, layer=layer)]
    return ModelSpec(tuple(tensors), layers, 0, False)


def test_design_example_t4_to_t2():
    rg = regroup(Layout(tp=4), 2, 1)
    assert rg.micro_dp == 2
    assert rg.micro_dp_groups() == [(0, 1), (2, 3)]
    assert sorted(rg.gen_groups("tp")) == [[0, 2], [1, 3]]
    assert rg.gen.dp == 2


def test_context_parallel_ranks_become_generation_replicas():
    rg = regroup(Layout(tp=2, cp=2), 1, 1)  # ranks: (tp, cp) = (0,0) (1,0) (0,1) (1,1)
    assert rg.micro_dp_groups() == [(0, 1), (2, 3)]  # each cp rank's two TP slices join
    assert rg.gen.dp == 4 and rg.gen.cp == 1
    assert sorted(rg.gen_coords(r)["dp"] for r in range(4)) == [0, 1, 2, 3]


def test_pipeline_regrouping_t2p2_to_t2p1():
    rg = regroup(Layout(tp=2, pp=2), 2, 1)
    assert rg.micro_dp_groups() == [(0, 2), (1, 3)]  # same slice, both stages
    assert sorted(rg.gen_groups("tp")) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("t,p,d,t_g,p_g,cp", [(4, 1, 1, 2, 1, 1), (2, 2, 1, 2, 1, 1), (4, 2, 1, 2, 1, 1),
                                              (2, 2, 2, 1, 1, 1), (8, 1, 1, 2, 1, 1), (4, 4, 1, 2, 2, 1),
                                              (2, 4, 2, 1, 2, 1), (8, 2, 1, 8, 1, 1),
                                              (1, 1, 1, 1, 1, 2), (2, 1, 1, 1, 1, 2), (2, 2, 1, 1, 1, 2),
                                              (4, 1, 2, 2, 1, 2), (2, 2, 2, 2, 1, 4)])
def test_bytes_equal_hybridflow_formula_per_rank(t, p, d, t_g, p_g, cp):
    """cp folds into data parallelism: the per-rank figures are those of cp=1."""
    model = split_only(layers=8)
    rg = regroup(Layout(tp=t, pp=p, dp=d, cp=cp), t_g, p_g)
    assert rg.gen.dp == d * cp * (t // t_g) * (p // p_g) and rg.gen.cp == 1
    plan = plan_reshard(model, rg, "micro_dp", 1 << 12)
    full = plan_reshard(model, rg, "full_gather", 1 << 12)
    expected = hybridflow_bytes(t, p, t_g, p_g, model.numel())
    for rank in range(rg.train.world_size):
        assert plan.received(rank) == expected["micro_dp_received"]
        assert full.received(rank) == expected["full_gather_received"]
        assert model.local_numel(plan.gen[rank]) == expected["micro_dp_peak"]
        assert rank_traffic(model, rg, rank)["received"] == plan.received(rank)


PAIRS = [((2, 1, 2, 1, 1), (1, 1, 1)), ((2, 2, 1, 1, 1), (1, 2, 1)), ((1, 2, 2, 2, 1), (1, 1, 1)),
         ((2, 2, 2, 2, 1), (2, 1, 2)), ((1, 4, 1, 1, 1), (1, 2, 1)), ((2, 1, 1, 1, 2), (1, 1, 1)),
         ((2, 2, 1, 1, 2), (2, 1, 1)), ((1, 1, 2, 2, 2), (1, 1, 2))]


@pytest.mark.parametrize("name,train,gen", [(n, t, g) for n in MODELS for t, g in PAIRS
                                            if (MODELS[n].num_experts or (t[3] == 1 and g[2] == 1))
                                            and not (n in BIASED_EXPERTS and t[0] > 1 and t[3] == 1)])
def test_every_generation_element_arrives_once(name, train, gen):
    model = MODELS[name]
    t, p, d, e, cp = train
    rg = regroup(Layout(tp=t, pp=p, dp=d, ep=e, etp=1 if e > 1 else None, cp=cp), *gen, model.num_experts)
    plan = plan_reshard(model, rg, "micro_dp", 1 << 10)
    for rank in range(rg.train.world_size):
        covered = defaultdict(list)
        for seg in plan.local.get(rank, []) + [s for b in plan.buckets for s in b if s.dst == rank]:
            assert seg.dst == rank
            covered[seg.tensor].append((seg.start, seg.stop))
            holders = {h for h in range(rg.train.world_size)
                       if any(lt.spec == seg.tensor and any(pc.start <= seg.start and seg.stop <= pc.stop for pc in lt.pieces)
                              for lt in plan.sources[h])}
            assert seg.src in holders, "a sender that does not hold the range"
        assert_covers_once(covered, plan.gen[rank])


def assert_covers_once(covered, shard) -> None:
    """The ranges received per tensor (``covered``: tensor -> [(start, stop)]) make up exactly
    the pieces of ``shard``'s tensors: every element once, nothing outside."""
    covered = dict(covered)
    for gen_tensor in shard:
        ranges = sorted(covered.pop(gen_tensor.spec))
        wanted = [(pc.start, pc.stop) for pc in gen_tensor.pieces]
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(ranges, ranges[1:])), "an element twice"
        assert all(any(w0 <= lo and hi <= w1 for w0, w1 in wanted) for lo, hi in ranges)
        assert sum(hi - lo for lo, hi in ranges) == sum(hi - lo for lo, hi in wanted)
    assert not covered, "ranges received for tensors outside the generation shard"


LAYOUTS = [Layout(tp=2, dp=2), Layout(pp=2, dp=2), Layout(tp=2, pp=2, vpp=2), Layout(dp=4, ep=4, etp=1),
           Layout(tp=2, dp=2, ep=2, etp=1), Layout(tp=2, dp=2, ep=2)]


@pytest.mark.parametrize("name,layout", [(n, lay) for n in MODELS for lay in LAYOUTS
                                         if (MODELS[n].num_experts or lay.ep == 1)
                                         and not (n in BIASED_EXPERTS and lay.etp != 1)])
def test_placement_covers_each_tensor_once_per_replica(name, layout):
    model = MODELS[name]
    placement = Placement(model, layout)
    held = defaultdict(int)
    for rank in range(layout.world_size):
        for local in placement.local_tensors(rank):
            spec = model.tensors[local.spec]
            held[local.spec] += spec.slice_numel(sum(pc.stop - pc.start for pc in local.pieces))
    for i, spec in enumerate(model.tensors):
        replicas = held[i] // spec.numel
        assert held[i] % spec.numel == 0 and replicas >= 1, spec.key


def test_bucket_limits_every_rank():
    model, cap = MODELS["tiny-qwen3-moe"], 3000
    rg = regroup(Layout(tp=2, dp=2, ep=2, etp=1), 1, 1, 1, model.num_experts)
    plan = plan_reshard(model, rg, "micro_dp", cap)
    assert len(plan.buckets) > 5
    assert max_bucket_load(plan) <= cap


def max_bucket_load(plan) -> int:
    """The most elements any one rank sends plus receives in one bucket of ``plan``."""
    most = 0
    for bucket in plan.buckets:
        load = defaultdict(int)
        for seg in bucket:
            load[seg.src] += plan.elems(seg)
            load[seg.dst] += plan.elems(seg)
        most = max(most, *load.values())
    return most


def test_invalid_pairs_list_valid_sizes():
    with pytest.raises(ReshardError, match=r"valid: .*\(t_g=1, p_g=1\).*\(t_g=2, p_g=2\)"):
        regroup(Layout(tp=4, pp=2), 3, 1)
    with pytest.raises(ReshardError, match="p_g must divide pp"):
        regroup(Layout(tp=2, pp=2), 1, 3)
    with pytest.raises(ReshardError, match="no experts"):
        regroup(Layout(tp=2), 1, 1, 2, 0)
    with pytest.raises(ReshardError, match=r"ep=3 must divide num_experts=4; valid: \[1, 2, 4\]"):
        regroup(Layout(tp=2, dp=2, ep=2, etp=1), 1, 1, 3, 4)
    with pytest.raises(ValueError, match="mode"):
        plan_reshard(MODELS["tiny-llama"], regroup(Layout(tp=2), 1, 1), "broadcast")


def test_moe_bytes_never_exceed_the_shard():
    model = MODELS["tiny-deepseek-v3"]
    rg = regroup(Layout(tp=2, dp=2, ep=2, etp=1), 1, 1, 1, model.num_experts)
    for rank in range(4):
        traffic = rank_traffic(model, rg, rank)
        assert 0 < traffic["received"] <= traffic["gen_shard"]
        assert traffic["received"] + traffic["train_shard"] >= traffic["gen_shard"]


def test_formula_helper_matches_table_2():
    figures = hybridflow_bytes(4, 2, 2, 1, 800)
    assert figures["micro_dp_received"] == Fraction(6, 16) * 800
    assert figures["full_gather_received"] == Fraction(7, 8) * 800
    assert figures["micro_dp_peak"] == 400 and figures["full_gather_peak"] == 800
