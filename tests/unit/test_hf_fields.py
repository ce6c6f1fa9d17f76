"""Every field of the pinned transformers' config classes is classified (megarl.models.hf_config.FIELDS):
mapped onto Megatron, inert (no effect on the math), or honoured only at some values and refused by
name otherwise. A field a new transformers adds fails here until someone classifies it."""

from __future__ import annotations

import inspect
import json
import warnings

import pytest
import transformers

from megarl.models.hf_config import FIELDS, INERT, MAPPED, Only, UnsupportedModelError, megatron_args_from_hf

CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mixtral": transformers.MixtralConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "deepseek_v3": transformers.DeepseekV3Config,
    "glm4_moe": transformers.Glm4MoeConfig,
    "gpt_oss": transformers.GptOssConfig,
    "qwen3_next": transformers.Qwen3NextConfig,
    "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
    "qwen3_5_moe": transformers.Qwen3_5MoeConfig,  # the vision-language wrapper: its text_config is read
}

# Per model_type, one refused setting for each Only field: {field: overrides that make it bite}.
SLIDING_QWEN = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0, "layer_types": None}
COMMON_BAD = {
    "hidden_act": {"hidden_act": "gelu"},
    "attention_bias": {"attention_bias": True},
    "quantization_config": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
}
BAD = {
    "glm4_moe": {  # transformers' Glm4Moe biases q/k/v by attention_bias, never o_proj
        **{k: v for k, v in COMMON_BAD.items() if k != "attention_bias"},
        "n_shared_experts": {"n_shared_experts": 0},
        "norm_topk_prob": {"norm_topk_prob": False},
        "n_group": {"n_group": 8, "topk_group": 4, "num_experts_per_tok": 4},
    },
    "llama": {**COMMON_BAD, "mlp_bias": {"mlp_bias": True}},
    "mistral": COMMON_BAD,  # its sliding_window maps to Megatron's window_size
    "qwen2": {k: v for k, v in {**COMMON_BAD, "sliding_window": SLIDING_QWEN}.items() if k != "attention_bias"},
    "qwen3": {**COMMON_BAD, "sliding_window": SLIDING_QWEN},
    "mixtral": {**COMMON_BAD, "sliding_window": {"sliding_window": 4096},
                "num_experts_per_tok": {"num_experts_per_tok": 1},
                "router_jitter_noise": {"router_jitter_noise": 0.01}},
    "qwen3_moe": {**COMMON_BAD, "sliding_window": {"use_sliding_window": True, "sliding_window": 16},
                  "norm_topk_prob": {"norm_topk_prob": True, "num_experts_per_tok": 1}},
    "qwen2_moe": {  # transformers' Qwen2-MoE ignores attention_bias (qkv_bias biases q/k/v)
        **{k: v for k, v in COMMON_BAD.items() if k != "attention_bias"},
        # the default layer_types: layers 0, 2, ... below max_window_layers slide
        "sliding_window": {"use_sliding_window": True, "sliding_window": 16, "layer_types": None},
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 0},
        "norm_topk_prob": {"norm_topk_prob": True, "num_experts_per_tok": 1},
    },
    "deepseek_v3": {
        **COMMON_BAD,
        "num_key_value_heads": {"num_key_value_heads": 64},
        "rope_interleave": {"rope_interleave": False},
        "norm_topk_prob": {"norm_topk_prob": False},
        "n_group": {"n_group": 8, "topk_group": 4, "num_experts_per_tok": 4},
        "scoring_func": {"scoring_func": "softmax"},
        "topk_method": {"topk_method": "greedy"},
        "moe_layer_freq": {"moe_layer_freq": 2},
        "rope_parameters": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                "original_max_position_embeddings": 4096, "truncate": False}},
    },
    "qwen3_next": {
        **COMMON_BAD,
        "layer_types": {"layer_types": ["linear_attention"] * 47 + ["sliding_attention"]},
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 0},
        "norm_topk_prob": {"norm_topk_prob": True, "num_experts_per_tok": 1},
    },
    "qwen3_5_moe_text": {
        **COMMON_BAD,
        "layer_types": {"layer_types": ["linear_attention"] * 39 + ["sliding_attention"]},
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 0},
        "num_experts_per_tok": {"num_experts_per_tok": 1},
    },
    "qwen3_5_moe": {},  # its text model's fields are refused as qwen3_5_moe_text's (test below)
    "gpt_oss": {  # transformers' GptOss ignores hidden_act (its experts' clamped SwiGLU is fixed)
        **{k: v for k, v in COMMON_BAD.items() if k not in ("hidden_act", "attention_bias")},
        "attention_bias": {"attention_bias": False},
        "swiglu_alpha": {"swiglu_alpha": 1.5},
        "num_experts_per_tok": {"num_experts_per_tok": 1},
        "rope_parameters": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096,
                                                "attention_factor": 1.0}},
    },
}


def class_fields(cls) -> set:
    """What the installed config class knows: its serialised keys, constructor arguments and aliases."""
    params = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs", "args"}
    return set(cls().to_dict()) | params | set(getattr(cls, "attribute_map", {}))


def default_config(model_type: str) -> dict:
    """The config class's defaults, as a config.json reads back (every family's defaults map: the
    last one refused, MistralConfig()'s 4096-token window over 131072 positions, maps to Megatron's
    window_size=(4095, 0))."""
    return json.loads(json.dumps(CLASSES[model_type]().to_dict()))


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_every_field_of_the_transformers_class_is_classified(model_type):
    table = FIELDS[model_type]
    unclassified = sorted(class_fields(CLASSES[model_type]) - set(table))
    assert not unclassified, f"{model_type}: classify these in megarl.models.hf_config.FIELDS: {unclassified}"
    assert all(kind in (MAPPED, INERT) or isinstance(kind, Only) for kind in table.values())


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_transformers_defaults_are_honoured(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no field of the class is unknown either
        megatron_args_from_hf(default_config(model_type))


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_every_refused_field_has_a_case_here(model_type):
    refused = {name for name, kind in FIELDS[model_type].items() if isinstance(kind, Only)}
    assert refused == set(BAD[model_type])


CASES = [(t, name) for t in sorted(BAD) for name in sorted(BAD[t])]


@pytest.mark.parametrize("model_type,name", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_refused_field_raises_naming_it(model_type, name):
    hf = {**default_config(model_type), **BAD[model_type][name]}
    with pytest.raises(UnsupportedModelError, match=f"config field {name}=") as err:
        megatron_args_from_hf(hf)
    assert isinstance(err.value, ValueError)  # the CLI's exit 2
    assert FIELDS[model_type][name].supported in str(err.value)


def test_unknown_field_warns_with_its_name():
    with pytest.warns(UserWarning, match="made_up_scaling"):
        megatron_args_from_hf({**default_config("llama"), "made_up_scaling": 2.0})


@pytest.mark.parametrize("over", [
    {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0},  # Qwen2.5 hub style
    {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 32, "layer_types": None},
    {"use_sliding_window": True, "sliding_window": 4096, "layer_types": ["full_attention"] * 32},
])
def test_qwen_sliding_window_settings_that_slide_no_layer_are_accepted(over):
    megatron_args_from_hf({**default_config("qwen2"), **over})


@pytest.mark.parametrize("over", [
    {"use_sliding_window": False, "sliding_window": 4096},  # Qwen1.5-MoE hub style
    {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0, "layer_types": None},
    {"use_sliding_window": True, "sliding_window": 4096, "layer_types": ["full_attention"] * 24},
])
def test_qwen2_moe_sliding_window_settings_that_slide_no_layer_are_accepted(over):
    megatron_args_from_hf({**default_config("qwen2_moe"), **over})


def test_qwen2_moe_default_layer_types_slide_every_other_layer():
    hf = {**default_config("qwen2_moe"), "use_sliding_window": True, "sliding_window": 4096,
          "max_window_layers": 1, "layer_types": None, "num_hidden_layers": 4}
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096"):  # layer 0 slides
        megatron_args_from_hf(hf)
    assert transformers.Qwen2MoeConfig(**{k: hf[k] for k in ("use_sliding_window", "sliding_window",
                                                              "max_window_layers", "num_hidden_layers")}
                                       ).layer_types[0] == "sliding_attention"


def test_glm4_moe_hub_style_keys_are_known():
    """GLM-4.5's config.json style (transformers 4.x): top-level rope_theta and
    partial_rotary_factor, head_dim, num_nextn_predict_layers; no field is unknown."""
    hf = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
          "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
          "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
          "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
          "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
          "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
          "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
          "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.54.0",
          "use_cache": True, "use_qk_norm": False, "vocab_size": 151552}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = megatron_args_from_hf(hf)
    assert args.rotary_percent == 0.5 and args.config_kwargs["kv_channels"] == 128
    assert args.config_kwargs["rotary_base"] == 1000000


def test_cli_refuses_before_launching(tmp_path, capsys):
    """``megarl convert`` refuses an unsupported field in its prepare step (exit 2, nothing written,
    no process started: --nproc would launch torchrun only after that step)."""
    import torch
    from safetensors.torch import save_file

    from megarl.cli import main

    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads(open("configs/models/tiny-deepseek-v3.json").read())
    (hf / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    save_file({"unread": torch.zeros(1)}, hf / "model.safetensors")  # the config is refused first
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "out"), "--nproc", "2"]) == 2
    assert "norm_topk_prob=False" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("over,layout,named", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                          "original_max_position_embeddings": 4096, "attention_factor": 1.0}}, [],
     "rope_parameters="),
    ({"swiglu_alpha": 1.5}, [], "swiglu_alpha=1.5"),
    ({}, ["--tp", "2", "--ep", "2", "--etp", "2"], "etp=2 must be 1"),  # biased experts
])
def test_cli_refuses_gpt_oss_settings_before_launching(tmp_path, capsys, over, layout, named):
    import torch
    from safetensors.torch import save_file

    from megarl.cli import main

    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads(open("configs/models/tiny-gpt-oss.json").read())
    (hf / "config.json").write_text(json.dumps({**config, **over}))
    save_file({"unread": torch.zeros(1)}, hf / "model.safetensors")
    if layout:  # names are checked before the layout: give the real ones (empty)
        from megarl.models.hf_config import megatron_args_from_hf
        from megarl.models.hf_mapping import build_plan

        save_file({n: torch.zeros(1) for n in build_plan(megatron_args_from_hf(hf), 128).hf_names()},
                  hf / "model.safetensors")
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "out"), *layout, "--nproc", "4"]) == 2
    assert named in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_train_refuses_in_its_prepare_step(tmp_path, capsys):
    from megarl.cli import main

    config = json.loads(open("configs/models/tiny-deepseek-v3.json").read())
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**config, "n_group": 4, "topk_group": 2, "n_routed_experts": 8}))
    assert main(["train", "configs/grpo_demo.yaml", f"model.hf_config={bad}", "--dry-run"]) == 2
    assert "n_group=4" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_sliding_window_on_an_unchecked_rollout_engine_is_refused(tmp_path, capsys, engine):
    """Mistral's window runs on the native engine (the Megatron model's SDPA attention); vLLM's and
    SGLang's handling of it is unverified, so such a run is refused in the prepare step."""
    from megarl.cli import main

    config = json.loads(open("configs/models/tiny-mistral.json").read())
    windowed = tmp_path / "config.json"
    windowed.write_text(json.dumps({**config, "sliding_window": 8}))
    args = ["train", "configs/grpo_demo.yaml", f"model.hf_config={windowed}", "--dry-run"]
    assert main(args + [f"parallel.rollout.engine={engine}"]) == 2
    assert f"parallel.rollout.engine={engine} with a sliding-window model" in capsys.readouterr().err
    assert main(args) == 0  # the native engine


@pytest.mark.parametrize("model,named", [("tiny-qwen3-next", "gated delta net"), ("tiny-qwen3-5-moe", "gated delta net")])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_gated_delta_net_on_an_unchecked_rollout_engine_is_refused(capsys, model, named, engine):
    """The gated delta nets' SGLang/vLLM loaders and kernels are unchecked against megarl's weight
    sync (its HF names are: test_sglang_pieces): refused in the prepare step (exit 2); the native
    engine runs them."""
    from megarl.cli import main

    args = ["train", "configs/grpo_demo.yaml", f"model.hf_config=configs/models/{model}.json", "parallel.actor={tp: 2, ep: 2, etp: 1}",
            "--dry-run"]
    assert main(args + [f"parallel.rollout.engine={engine}"]) == 2
    err = capsys.readouterr().err
    assert f"parallel.rollout.engine={engine}" in err and named in err and "rollout.engine=native" in err
    assert main(args) == 0


def test_a_wrapped_text_config_is_checked_as_its_text_model():
    """Qwen3.5's vision-language config: a refused field of its text_config is named as the text
    model's (and the wrapper's own fields are classified: the tests above)."""
    hf = default_config("qwen3_5_moe")
    hf["text_config"] = {**hf["text_config"], "num_experts_per_tok": 1}
    with pytest.raises(UnsupportedModelError, match="qwen3_5_moe_text config field num_experts_per_tok=1"):
        megatron_args_from_hf(hf)
    args = megatron_args_from_hf(default_config("qwen3_5_moe"))
    assert args.model_type == "qwen3_5_moe_text" and args.hf_prefix == "model.language_model."
    assert args.carried == ("model.visual.",)
