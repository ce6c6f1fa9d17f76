"""The hybrid engine's plans against models built from Transformer Engine's layer spec.

Plans name tensors as the local spec does; :func:`canonical_name` reads a built model's names back.
Transformer Engine is not installed here, so each rank's model chunks are walked from
megatron-core's TE spec (as in ``test_te_key_names``) into the names ``named_parameters`` and
the persistent buffers give: submodule paths from megatron-core, leaf parameters as TE's modules
register them. Each planned tensor must be one of them and each of them planned, in every layout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.hybrid import ModelSpec
from megarl.hybrid.names import FUSED_NORMS, canonical_name, check_planned, planned_tensors
from megarl.hybrid.shards import LocalTensor, Placement
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout
from tests.unit.test_te_key_names import (  # noqa: F401 (te_specs: a fixture)
    PARAMS, ROOT, _config, _name, _shared_gate, _unused, te_specs,
)

MODELS = ["tiny-llama", "tiny-deepseek-v3", "tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe", "tiny-glm4-moe",
          "tiny-gpt-oss"]
LAYOUTS = [Layout(), Layout(tp=2, pp=2, dp=2), Layout(tp=2, pp=2, dp=2, ep=2, etp=1), Layout(tp=2, pp=2, vpp=2)]


def _layer_names(spec, config, local_experts: int, prefix: str = "") -> set:
    """Names of the parameters and persistent buffers a module built from ``spec`` registers."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if _name(module) is None:  # a function (bias-dropout-add), or nothing
        return set()
    bias = config.add_bias_linear  # GptOss: every linear, the router and the experts
    params = ("weight", "bias") if bias else ("weight",)
    if module is TopKRouter:
        return ({prefix + "weight"} | ({prefix + "expert_bias"} if config.moe_router_enable_expert_bias else set())
                | ({prefix + "bias"} if bias else set()))
    if module is TEGroupedMLP:  # one TE GroupedLinear per linear, a weight (bias) per local expert
        return {f"{prefix}{linear}.{p}{e}" for linear in ("linear_fc1", "linear_fc2") for p in params
                for e in range(local_experts)}
    if module is SequentialMLP:
        return {f"{prefix}local_experts.{e}.{linear}.{p}" for linear in ("linear_fc1", "linear_fc2")
                for p in params for e in range(local_experts)}
    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        name = _name(module)
        qkv_bias = prefix.endswith("linear_qkv.") and config.add_qkv_bias
        sinks = name.endswith("DotProductAttention") and config.softmax_type == "learnable"
        extra = (("bias",) if qkv_bias or (name.endswith("Linear") and bias) else ()) + (
            ("softmax_offset",) if sinks else ())
        return {prefix + p for p in PARAMS[name] + extra}
    names = {prefix + "gate_weight"} if _shared_gate(module, config) else set()
    for field in dataclasses.fields(submodules):
        if not _unused(_name(module), field.name, config):
            names |= _layer_names(getattr(submodules, field.name), config, local_experts, f"{prefix}{field.name}.")
    return names


def _chunk_names(specs, config, placement: Placement, rank: int, chunk: int) -> set:
    """Names of model chunk ``chunk`` of ``rank`` in ``placement``'s layout, built from ``specs``."""
    layout, model = placement.layout, placement.model
    pp = layout.coords(rank)["pp"]
    last_chunk = (layout.vpp or 1) - 1
    names = set()
    if pp == 0 and chunk == 0:
        names.add("embedding.word_embeddings.weight")
    if pp == layout.pp - 1 and chunk == last_chunk:
        names.add("decoder.final_layernorm.weight")
        if not model.tied_embeddings or layout.pp > 1:  # the tied output layer's copy on the last stage
            names.add("output_layer.weight")
    for layer, spec in enumerate(specs):
        stage, layer_chunk, local = placement.layer_home(layer)
        if (stage, layer_chunk) == (pp, chunk):
            names |= _layer_names(spec, config, placement.experts_per_rank, f"decoder.layers.{local}.")
    return names


def _cases():
    """(model, layout) pairs; expert-parallel layouts for the models that have experts."""
    for name in MODELS:
        args = megatron_args_from_hf(str(ROOT / f"configs/models/{name}.json"))
        moe, biased = bool(args.num_experts), bool(args.config_kwargs.get("add_bias_linear"))
        for layout in LAYOUTS:
            if (moe or layout.ep == 1) and not (biased and layout.etp != 1):  # biased experts: etp=1 only
                yield pytest.param(name, layout, id=f"{name}-{layout}")


@pytest.mark.parametrize("name,layout", list(_cases()))
@pytest.mark.parametrize("te", [True, False], ids=["transformer_engine", "local"])
def test_every_planned_tensor_is_a_built_tensor_and_back(te_specs, name, layout, te):
    args, config = _config(name, te)
    specs = te_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization="RMSNorm")
    placement = Placement(ModelSpec.from_args(args), layout)
    renamed = 0
    for rank in range(layout.world_size):
        planned = placement.local_tensors(rank)
        for chunk in range(layout.vpp or 1):
            built = _chunk_names(specs, config, placement, rank, chunk)
            canonical = {canonical_name(n): n for n in built}
            assert len(canonical) == len(built), f"{name}: two built names read as one"
            mine = {t.name for t in planned if t.chunk == chunk}
            assert set(canonical) == mine, (
                f"{name} rank {rank} chunk {chunk} ({'TE' if te else 'local'} spec, {layout}): unplanned "
                f"{sorted(canonical[n] for n in set(canonical) - mine)}; not built {sorted(mine - set(canonical))}")
            renamed += sum(n != c for c, n in canonical.items())
    assert (renamed > 0) == te  # the local spec's names are the plan's own


def test_fused_norms_are_megatron_cores_renames(te_specs):
    """The GQA renames are those of megatron-core's local spec's checkpoint keys map."""
    _, config = _config("tiny-llama", te=False)
    spec = te_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")[0]
    assert spec.submodules.sharded_state_dict_keys_map.items() <= set(FUSED_NORMS)


@pytest.mark.parametrize("built,plan", [
    ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.3.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.pre_mlp_layernorm.weight"),
    ("decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
     "decoder.layers.1.self_attention.q_layernorm.weight"),
    ("decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
     "decoder.layers.1.self_attention.kv_layernorm.weight"),
    ("decoder.layers.2.mlp.experts.linear_fc1.weight11", "decoder.layers.2.mlp.experts.local_experts.11.linear_fc1.weight"),
    ("decoder.layers.2.mlp.experts.linear_fc2.weight0", "decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight"),
    ("decoder.layers.2.self_attention.linear_qkv.weight", "decoder.layers.2.self_attention.linear_qkv.weight"),
    ("decoder.layers.2.mlp.shared_experts.linear_fc1.weight", "decoder.layers.2.mlp.shared_experts.linear_fc1.weight"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
])
def test_canonical_name(built, plan):
    assert canonical_name(built) == plan
    assert canonical_name(plan) == plan


def _module(names) -> torch.nn.Module:
    """A module tree whose parameters have ``names``."""
    root = torch.nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(2)))
    return root


def test_lookups_use_plan_names_and_refuse_unplanned_parameters():
    te = _module(["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                  "decoder.layers.0.mlp.experts.linear_fc1.weight1"])
    named = planned_tensors(te)
    assert set(named) == {"decoder.layers.0.input_layernorm.weight",
                          "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"}
    assert named["decoder.layers.0.input_layernorm.weight"] is te.get_parameter(
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    plan = [LocalTensor(0, n, i, (2,), ()) for i, n in enumerate(named)]
    check_planned([te], plan, "rank 0")
    with pytest.raises(ValueError, match=r"experts\.linear_fc1\.weight1.*no plan entry"):
        check_planned([te], plan[:1], "rank 0")
    with pytest.raises(ValueError, match="both read as"):
        planned_tensors(_module(["decoder.layers.0.input_layernorm.weight",
                                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]))
