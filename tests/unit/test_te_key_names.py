"""The converter's tables against megatron-core's own layer specs, Transformer Engine's included.

Transformer Engine is not installed here, but megatron-core's TE spec functions only name TE
classes (placeholders without TE, told apart by identity), so the TE spec of each architecture
can be built and walked: each submodule's path
plus the parameters its module registers gives every checkpoint key of a layer. The TE modules'
own parameter names (``layer_norm_weight`` of the fused norm-linear) are Transformer Engine's
and listed here; the paths, the fusions and the key renames come from megatron-core. Each key
must have exactly one rule in the table, and each rule of a layer must name a key of the spec.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import ModelConfig
from megarl.models.hf_config import megatron_args_from_hf
from megarl.models.hf_mapping import layer_rules
from megarl.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral",
          "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-gpt-oss"]
# Parameters each leaf module registers (RMSNorm: no biases); with add_bias_linear (GptOss) every
# linear also has a "bias", and with softmax_type 'learnable' the core attention a "softmax_offset".
PARAMS = {
    "TELayerNormColumnParallelLinear": ("layer_norm_weight", "weight"),
    "TENorm": ("weight",), "TELinear": ("weight",),
    "TEColumnParallelLinear": ("weight",), "TERowParallelLinear": ("weight",),
    "ColumnParallelLinear": ("weight",), "RowParallelLinear": ("weight",),
    "WrappedTorchNorm": ("weight",), "FusedLayerNorm": ("weight",),
    "TEDotProductAttention": (), "DotProductAttention": (), "IdentityOp": (), "IdentityFuncOp": (),
}


_TE_NAMES = {}  # id of megatron-core's placeholder for a TE class -> the class's name


@pytest.fixture
def te_specs(monkeypatch):
    """megatron-core's TE spec functions, callable without Transformer Engine: the names they
    import only when TE is present, TE's version check (as for TE >= 1.9), and the grouped
    linears (None without TE; TE >= 1.7 has them, and the spec then picks TEGroupedMLP)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te.TENorm, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda version: True)
    for grouped in ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"):
        monkeypatch.setattr(provider, grouped, type(grouped, (), {}))
    _TE_NAMES.update({id(getattr(te, name)): name for name in PARAMS if hasattr(te, name)})
    return gpt_layer_specs


def _name(module):
    return module.__name__ if isinstance(module, type) else _TE_NAMES.get(id(module))


def _config(name: str, te: bool):
    from megarl.models.builder import transformer_config

    hf = json.loads((ROOT / "configs" / "models" / f"{name}.json").read_text())
    args = megatron_args_from_hf(hf)
    groups = SimpleNamespace(layout=Layout(tp=1, pp=1, dp=1))
    config = transformer_config(args, groups, ModelConfig(hf_config=hf, transformer_impl="local"), initialize=False)
    config.moe_grouped_gemm = te  # what megarl's builder sets with TE (TEGroupedMLP)
    return args, config


def _keys(spec, config, prefix: str = "") -> set:
    """Checkpoint keys of the parameters a layer spec builds."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if _name(module) is None:  # a function (bias-dropout-add), or nothing
        return set()
    bias = config.add_bias_linear
    if module is TopKRouter:
        return ({prefix + "weight"} | ({prefix + "expert_bias"} if config.moe_router_enable_expert_bias else set())
                | ({prefix + "bias"} if bias else set()))
    if module in (SequentialMLP, TEGroupedMLP):  # both save every expert as "experts.<linear>.weight"
        return {f"{prefix}experts.{linear}.{p}" for linear in ("linear_fc1", "linear_fc2")
                for p in (("weight", "bias") if bias else ("weight",))}
    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        name = _name(module)
        linear = name.endswith("Linear")
        qkv_bias = prefix.endswith("linear_qkv.") and config.add_qkv_bias
        sinks = name.endswith("DotProductAttention") and config.softmax_type == "learnable"
        extra = (("bias",) if qkv_bias or (linear and bias) else ()) + (("softmax_offset",) if sinks else ())
        return {prefix + p for p in PARAMS[name] + extra}
    keys = {prefix + "gate_weight"} if _shared_gate(module, config) else set()
    for field in dataclasses.fields(submodules):
        if _unused(_name(module), field.name, config):
            continue
        keys |= _keys(getattr(submodules, field.name), config, f"{prefix}{field.name}.")
    for old, new in getattr(submodules, "sharded_state_dict_keys_map", {}).items():
        keys = {prefix + new + k[len(prefix + old):] if k.startswith(prefix + old) else k for k in keys}
    return keys


def _shared_gate(module, config) -> bool:
    """The shared experts' sigmoid gate, a parameter SharedExpertMLP registers itself."""
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    return module is SharedExpertMLP and config.moe_shared_expert_gate


def _unused(module: str, field: str, config) -> bool:
    """Submodules a spec lists but the module does not build for this config."""
    if module == "MLASelfAttention":  # a plain q projection without q-LoRA, else down/norm/up
        low_rank = config.q_lora_rank is not None
        return field == "linear_q_proj" if low_rank else field in ("linear_q_down_proj", "linear_q_up_proj", "q_layernorm")
    return module == "MoELayer" and field == "shared_experts" and not config.moe_shared_expert_intermediate_size


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("te", [True, False], ids=["transformer_engine", "local"])
def test_every_spec_key_has_exactly_one_rule(te_specs, name, te):
    args, config = _config(name, te)
    specs = te_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization="RMSNorm")
    for layer, spec in enumerate(specs):
        keys = _keys(spec, config)
        rules = layer_rules(args, layer)
        named = [(r.te or r.mcore) if te else r.mcore for r in rules]
        assert len(named) == len(set(named)), (name, layer, named)
        assert set(named) == keys, (f"{name} layer {layer} ({'TE' if te else 'local'} spec): no rule for "
                                    f"{sorted(keys - set(named))}; rules without a key: {sorted(set(named) - keys)}")


def test_te_names_differ_where_expected(te_specs):
    """The TE spec fuses MLA's latent norms into the up-projections: keys the local spec lacks."""
    args, config = _config("tiny-deepseek-v3", te=True)
    specs = te_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=True, normalization="RMSNorm")
    keys = _keys(specs[0], config)
    assert {"self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"} <= keys
    assert "pre_mlp_layernorm.weight" in _keys(specs[1], config)  # kept apart before an MoE layer


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe",
                                  "tiny-qwen2-moe", "tiny-mixtral", "tiny-glm4-moe"])
@pytest.mark.parametrize("te", [True, False], ids=["transformer_engine", "local"])
def test_lora_targets_are_linears_of_the_spec(te_specs, name, te):
    """Every linear megarl.models.lora adapts (attention only for MoE models, which it allows) is a
    weight of megatron-core's own layer spec under the same path, TE or local; under TE the
    column-parallel ones carry the fused norm the adapter applies to its input."""
    from megarl.config.schema import LoRAConfig
    from megarl.models import lora

    args, config = _config(name, te)
    moe = bool(args.num_experts)
    targets = ["linear_qkv", "linear_proj"] if moe else list(LoRAConfig().target_modules)
    lora.check_targets(LoRAConfig(rank=8, target_modules=targets), args)
    specs = te_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=te, normalization="RMSNorm")
    for layer, spec in enumerate(specs):
        keys = _keys(spec, config)
        for key in lora.target_parts(targets):
            assert f"{key}.weight" in keys, (name, layer, key)
        if te:
            assert "self_attention.linear_qkv.layer_norm_weight" in keys
