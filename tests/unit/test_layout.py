"""Layouts: validation messages and Megatron's rank order, without any process group."""

from __future__ import annotations

import pytest

from megarl.config import ParallelConfig
from megarl.parallel import Layout, LayoutError


def test_dp_is_derived_from_world_size():
    layout = Layout.from_config(ParallelConfig(tp=2, pp=2), world_size=8)
    assert (layout.tp, layout.pp, layout.dp, layout.etp) == (2, 2, 2, 2)


@pytest.mark.parametrize("cfg, world, words", [
    (ParallelConfig(tp=2, pp=2), 6, ["world size 6", "tp*pp*cp", "4"]),
    (ParallelConfig(tp=2, dp=3), 4, ["tp*cp*dp*pp", "6", "world size 4"]),
    (ParallelConfig(tp=1, ep=4, etp=1), 2, ["etp*ep", "4", "tp*cp*dp = 2"]),
    (ParallelConfig(tp=2, ep=1, etp=1), 2, ["etp=1", "tp=2", "set etp=2"]),
    (ParallelConfig(tp=0), 2, ["tp=0"]),
    (ParallelConfig(tp=1, pp=1, vpp=2), 1, ["vpp=2", "pp > 1"]),
])
def test_impossible_layouts_name_the_sizes(cfg, world, words):
    with pytest.raises(LayoutError) as err:
        Layout.from_config(cfg, world)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_attention_heads=6), ["num_attention_heads = 6", "tp = 4"]),
    (dict(num_query_groups=2), ["num_query_groups", "tp = 4"]),
    (dict(num_layers=6), ["num_layers = 6", "pp = 4"]),
    (dict(num_experts=6), ["num_experts = 6", "ep = 4"]),
    (dict(padded_vocab_size=250), ["padded vocab size = 250"]),
])
def test_model_that_does_not_split(kwargs, words):
    layout = Layout(tp=4, pp=4, dp=1, ep=4, etp=1)
    model = dict(num_layers=8, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                 padded_vocab_size=256, num_experts=8, moe_ffn_hidden_size=16)
    model.update(kwargs)
    with pytest.raises(LayoutError) as err:
        layout.validate_model(**model)
    for word in words:
        assert word in str(err.value)


def test_ep_without_experts_is_refused():
    with pytest.raises(LayoutError, match="no experts"):
        Layout(tp=1, dp=2, ep=2).validate_model(num_layers=2, num_attention_heads=2, num_query_groups=2,
                                                 ffn_hidden_size=8, padded_vocab_size=128)


def test_coords_follow_megatron_order():
    # tp fastest, then cp, dp, pp; experts carve etp/ep/edp out of tp*cp*dp.
    layout = Layout(tp=2, pp=2, dp=2, ep=2, etp=1)
    got = [layout.coords(r) for r in range(8)]
    assert [c["tp"] for c in got] == [0, 1] * 4
    assert [c["dp"] for c in got] == [0, 0, 1, 1] * 2
    assert [c["pp"] for c in got] == [0] * 4 + [1] * 4
    assert [c["ep"] for c in got] == [0, 1] * 4
    assert [c["edp"] for c in got] == [0, 0, 1, 1] * 2
    with pytest.raises(LayoutError):
        layout.coords(8)
