"""Routed experts' biases (gpt_oss) in Megatron's local linears: builder.expert_biases_not_sequence_parallel
and builder.biased_experts_unreduced.

Megatron's local RowParallelLinear tags its bias ``sequence_parallel`` under sequence parallelism,
routed experts' too, and ``finalize_model_grads`` sums tagged gradients over the tensor-parallel
group. At tp=2·ep=2·etp=1 (gpt_oss) the two tp ranks hold different experts, so each expert's
``linear_fc2.bias`` gradient had the other rank's expert's added to it. Dense and shared-expert
biases keep the tag (their tp ranks saw different tokens of the same weights)."""

from __future__ import annotations

import torch

from megarl.models.builder import expert_biases_not_sequence_parallel


class _Linear(torch.nn.Module):
    """The attributes of Megatron's RowParallelLinear the builder reads."""

    def __init__(self, is_expert: bool, bias: bool = True):
        super().__init__()
        self.is_expert = is_expert
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))
        self.bias = torch.nn.Parameter(torch.zeros(4)) if bias else None
        if bias:
            self.bias.sequence_parallel = True  # as RowParallelLinear sets it under sequence parallelism


def test_only_routed_expert_biases_lose_the_tag():
    model = torch.nn.ModuleDict({
        "proj": _Linear(is_expert=False),  # attention's linear_proj
        "shared": _Linear(is_expert=False),  # a shared expert: dense, tp-split
        "expert0": _Linear(is_expert=True), "expert1": _Linear(is_expert=True),
        "unbiased": _Linear(is_expert=True, bias=False),
    })
    norm = torch.nn.Parameter(torch.ones(4))
    norm.sequence_parallel = True
    model.register_parameter("norm", norm)
    expert_biases_not_sequence_parallel([model])
    assert model["proj"].bias.sequence_parallel and model["shared"].bias.sequence_parallel and norm.sequence_parallel
    assert not model["expert0"].bias.sequence_parallel and not model["expert1"].bias.sequence_parallel
    assert model["unbiased"].bias is None


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


class _Fc2(_Linear):
    """A routed expert's linear_fc2 as Megatron builds it (skip_bias_add, input_is_parallel)."""

    def __init__(self, is_expert: bool, group_size: int, bias: bool = True, explicit: bool = False):
        super().__init__(is_expert, bias)
        self.skip_bias_add, self.input_is_parallel = True, True
        self.explicit_expert_comm, self.tp_group = explicit, _Group(group_size)


def test_biased_experts_skip_the_one_rank_reduction():
    """At ep=1 and expert tp 1, Megatron's MLP added a biased expert's bias in place to the view
    its one-rank all-reduce returned, which autograd refuses (gpt_oss could not train at ep=1)."""
    from megarl.models.builder import biased_experts_unreduced

    model = torch.nn.ModuleDict({"one": _Fc2(True, 1), "split": _Fc2(True, 2), "dense": _Fc2(False, 1),
                                 "unbiased": _Fc2(True, 1, bias=False), "ep": _Fc2(True, 1, explicit=True)})
    biased_experts_unreduced([model])
    assert {k: m.explicit_expert_comm for k, m in model.items()} == {
        "one": True, "split": False, "dense": False, "unbiased": False, "ep": True}

