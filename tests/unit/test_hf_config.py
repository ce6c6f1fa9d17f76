"""HF config.json -> Megatron arguments (megarl.models.hf_config).

Configs are built with transformers' own config classes (non-default, distinctive values) and
every mapped Megatron field is checked against the value worked out from the HF fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from megarl.models.hf_config import (
    ARCHITECTURES, MOE, UnsupportedModelError, megatron_args_from_hf, padded_vocab_size,
)

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIGS = sorted((REPO / "configs" / "models").glob("*.json"))
FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe",
            "gpt_oss", "qwen3_next", "qwen3_5_moe_text"}

MOE_FIELDS = {
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_router_pre_softmax", "moe_aux_loss_coeff", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_dtype", "moe_router_bias_update_rate",
}
MLA_FIELDS = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}


# ---------------------------------------------------------------------------------------------
# HF configs with distinctive values
# ---------------------------------------------------------------------------------------------

def common_kwargs(**over):
    kw = dict(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=3e-5,
              max_position_embeddings=777, initializer_range=0.013, attention_dropout=0.125,
              rope_parameters={"rope_type": "default", "rope_theta": 123456.0},
              tie_word_embeddings=True)
    kw.update(over)
    return kw


def llama(**over):
    kw = dict(head_dim=24)
    kw.update(over)
    return transformers.LlamaConfig(**common_kwargs(**kw)).to_dict()


def mistral(**over):
    kw = dict(head_dim=32, sliding_window=None)  # head_dim != hidden / heads, as in Mistral-Nemo
    kw.update(over)
    return transformers.MistralConfig(**common_kwargs(**kw)).to_dict()


def qwen2(**over):
    return transformers.Qwen2Config(**common_kwargs(**over)).to_dict()


def qwen3(**over):
    kw = dict(head_dim=40)
    kw.update(over)
    return transformers.Qwen3Config(**common_kwargs(**kw)).to_dict()


def qwen3_moe(**over):
    kw = dict(num_hidden_layers=6, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
              norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=2,
              router_aux_loss_coef=0.0123, head_dim=20)
    kw.update(over)
    return transformers.Qwen3MoeConfig(**common_kwargs(**kw)).to_dict()


def mixtral(**over):
    kw = dict(num_local_experts=5, num_experts_per_tok=2, router_aux_loss_coef=0.0321,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    kw.update(over)
    return transformers.MixtralConfig(**common_kwargs(**kw)).to_dict()


def qwen2_moe(**over):
    kw = dict(num_hidden_layers=6, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
              shared_expert_intermediate_size=56, mlp_only_layers=[1], decoder_sparse_step=2,
              router_aux_loss_coef=0.0123)
    kw.update(over)
    return transformers.Qwen2MoeConfig(**common_kwargs(**kw)).to_dict()


def deepseek_v3(**over):
    kw = dict(num_hidden_layers=5, num_key_value_heads=6, first_k_dense_replace=2, q_lora_rank=48,
              kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=12, v_head_dim=20,
              n_shared_experts=2, moe_intermediate_size=36, n_routed_experts=8,
              num_experts_per_tok=4, routed_scaling_factor=1.75, n_group=4, topk_group=2,
              tie_word_embeddings=False)
    kw.update(over)
    return transformers.DeepseekV3Config(**common_kwargs(**kw)).to_dict()


def glm4_moe(**over):
    kw = dict(num_hidden_layers=5, first_k_dense_replace=2, n_shared_experts=2, moe_intermediate_size=36,
              n_routed_experts=8, num_experts_per_tok=4, routed_scaling_factor=1.75, n_group=4, topk_group=2,
              attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.25, tie_word_embeddings=False)
    kw.update(over)
    return transformers.Glm4MoeConfig(**common_kwargs(**kw)).to_dict()


def gpt_oss(**over):
    kw = dict(num_hidden_layers=4, num_local_experts=6, num_experts_per_tok=3, head_dim=20,
              sliding_window=24, swiglu_limit=5.5, router_aux_loss_coef=0.0123,
              layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"])
    kw.update(over)
    return transformers.GptOssConfig(**common_kwargs(**kw)).to_dict()


# the delta nets, gated attention and shared-expert MoE Qwen3-Next and Qwen3.5 share
HYBRID = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, shared_expert_intermediate_size=56,
              head_dim=32, linear_conv_kernel_dim=3, linear_key_head_dim=12, linear_value_head_dim=20,
              linear_num_key_heads=2, linear_num_value_heads=6)


def qwen3_next(**over):
    kw = dict(HYBRID, num_hidden_layers=6, mlp_only_layers=[1], decoder_sparse_step=1, router_aux_loss_coef=0.0123,
              layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
              rope_parameters={"rope_type": "default", "rope_theta": 123456.0, "partial_rotary_factor": 0.375})
    kw.update(over)
    return transformers.Qwen3NextConfig(**common_kwargs(**kw)).to_dict()


def qwen3_5_moe_text(**over):
    kw = dict(HYBRID, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    kw.update(over)
    kw = {k: v for k, v in common_kwargs(**kw).items() if k != "intermediate_size"}  # Qwen3.5 has none
    return transformers.Qwen3_5MoeTextConfig(**kw).to_dict()


BUILDERS = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
            "qwen2_moe": qwen2_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe,
            "gpt_oss": gpt_oss, "qwen3_next": qwen3_next,
            "qwen3_5_moe_text": qwen3_5_moe_text}


def expected_common(hf):
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": hf["num_attention_heads"],
        "num_query_groups": hf["num_key_value_heads"],
        "kv_channels": head_dim,
        "layernorm_epsilon": hf["rms_norm_eps"],
        "init_method_std": hf["initializer_range"],
        "attention_dropout": hf["attention_dropout"],
        "rotary_base": hf["rope_parameters"]["rope_theta"],
    }


def check_common(args, hf):
    for name, value in expected_common(hf).items():
        assert args.config_kwargs[name] == value, name
    assert args.vocab_size == hf["vocab_size"]
    assert args.max_position_embeddings == hf["max_position_embeddings"]
    assert args.tie_word_embeddings == hf["tie_word_embeddings"]
    assert args.model_type == hf["model_type"]
    assert args.hf_config == hf


def check_dense(args):
    assert not MOE_FIELDS & set(args.config_kwargs), MOE_FIELDS & set(args.config_kwargs)
    assert not MLA_FIELDS & set(args.config_kwargs)
    assert args.num_experts is None
    assert args.mla is False


# ---------------------------------------------------------------------------------------------
# Dense architectures
# ---------------------------------------------------------------------------------------------

def test_llama_mapping():
    hf = llama()
    assert hf["head_dim"] == 24 != hf["hidden_size"] // hf["num_attention_heads"]
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    check_dense(args)
    assert args.config_kwargs["kv_channels"] == 24
    assert args.config_kwargs["num_query_groups"] == 2
    assert args.config_kwargs["rotary_base"] == 123456.0
    assert args.config_kwargs["layernorm_epsilon"] == 3e-5
    assert args.config_kwargs["add_qkv_bias"] is False
    assert "qk_layernorm" not in args.config_kwargs
    assert args.tie_word_embeddings is True
    assert args.vocab_size == 1000
    assert args.rope_scaling is None


def test_llama_attention_bias_false_and_defaults():
    args = megatron_args_from_hf(llama(attention_bias=False))
    assert args.config_kwargs["add_qkv_bias"] is False
    # no head_dim / num_key_value_heads in the file: derived from hidden_size and heads
    hf = llama()
    del hf["head_dim"], hf["num_key_value_heads"]
    args = megatron_args_from_hf(hf)
    assert args.config_kwargs["kv_channels"] == 96 // 6
    assert args.config_kwargs["num_query_groups"] == 6


def test_llama_old_style_rope_theta():
    hf = llama()
    del hf["rope_parameters"]
    hf["rope_theta"] = 654321.0
    hf["rope_scaling"] = None
    assert megatron_args_from_hf(hf).config_kwargs["rotary_base"] == 654321.0


def test_llama3_rope_scaling_passed_through():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = llama()
    hf["rope_parameters"] = dict(rope)
    args = megatron_args_from_hf(hf)
    assert args.config_kwargs["rotary_base"] == 500000.0
    assert args.rope_scaling["rope_type"] == "llama3"
    assert args.rope_scaling["factor"] == 32.0


def test_qwen2_mapping():
    hf = qwen2()
    assert "attention_bias" not in hf
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    check_dense(args)
    assert args.config_kwargs["kv_channels"] == 96 // 6
    assert args.config_kwargs["add_qkv_bias"] is True           # qwen2 always has qkv bias
    assert "qk_layernorm" not in args.config_kwargs
    # even if a file says attention_bias false, qwen2's q/k/v projections carry a bias
    assert megatron_args_from_hf({**hf, "attention_bias": False}).config_kwargs["add_qkv_bias"] is True


def test_qwen3_mapping():
    hf = qwen3()
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    check_dense(args)
    assert args.config_kwargs["kv_channels"] == 40
    assert args.config_kwargs["qk_layernorm"] is True
    assert args.config_kwargs["add_qkv_bias"] is False
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        megatron_args_from_hf(qwen3(attention_bias=True))


@pytest.mark.parametrize("bias", [{"attention_bias": True}, {"mlp_bias": True}])
def test_llama_biases_megatron_cannot_express_are_refused(bias):
    # HF's attention_bias also biases o_proj; Megatron only has add_qkv_bias / add_bias_linear.
    with pytest.raises(UnsupportedModelError, match=next(iter(bias))):
        megatron_args_from_hf(llama(**bias))


# ---------------------------------------------------------------------------------------------
# MoE architectures
# ---------------------------------------------------------------------------------------------

def test_qwen3_moe_mapping():
    hf = qwen3_moe()
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    kw = args.config_kwargs
    assert args.mla is False
    assert kw["kv_channels"] == 20
    assert kw["qk_layernorm"] is True
    assert kw["num_moe_experts"] == 6 == args.num_experts
    assert kw["moe_router_topk"] == 3
    assert kw["moe_ffn_hidden_size"] == 48
    assert kw["ffn_hidden_size"] == 200
    assert kw["moe_aux_loss_coeff"] == pytest.approx(0.0123)
    assert kw["moe_router_pre_softmax"] is False                # == not norm_topk_prob
    # 6 layers, sparse iff (i + 1) % 2 == 0 and i not in mlp_only_layers=[1]
    assert kw["moe_layer_freq"] == [0, 0, 0, 1, 0, 1]
    assert not MLA_FIELDS & set(kw)
    assert "moe_shared_expert_intermediate_size" not in kw


def test_qwen3_moe_norm_topk_prob_false_and_step_one():
    args = megatron_args_from_hf(qwen3_moe(norm_topk_prob=False, num_hidden_layers=4,
                                           decoder_sparse_step=1, mlp_only_layers=[1]))
    assert args.config_kwargs["moe_router_pre_softmax"] is True
    assert args.config_kwargs["moe_layer_freq"] == [1, 0, 1, 1]
    # a file without norm_topk_prob gets Qwen3MoeConfig's default, false: no renormalisation
    hf = qwen3_moe()
    del hf["norm_topk_prob"]
    assert megatron_args_from_hf(hf).config_kwargs["moe_router_pre_softmax"] is True


def test_qwen3_moe_with_zero_experts_is_dense():
    """HF builds every Qwen3-MoE layer as a dense MLP when num_experts == 0
    (``config.num_experts > 0 and ...`` in Qwen3MoeDecoderLayer). Megatron rejects
    num_moe_experts=0 ("num_moe_experts must be non-negative"), so the mapping must either
    give a dense model (no MoE fields) or refuse the config up front."""
    hf = qwen3_moe(num_experts=0)
    try:
        args = megatron_args_from_hf(hf)
    except UnsupportedModelError:
        return
    assert args.num_experts is None
    assert not MOE_FIELDS & set(args.config_kwargs), MOE_FIELDS & set(args.config_kwargs)


def test_qwen3_moe_hub_style_num_experts_key():
    """Hub config.json files written by older transformers use ``num_experts``."""
    hf = qwen3_moe()
    hf["num_experts"] = hf.pop("num_local_experts")
    assert megatron_args_from_hf(hf).config_kwargs["num_moe_experts"] == 6


def test_qwen2_moe_mapping():
    hf = qwen2_moe()
    assert hf["qkv_bias"] is True and hf["norm_topk_prob"] is False  # Qwen2MoeConfig's defaults
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    kw = args.config_kwargs
    assert kw["kv_channels"] == 96 // 6
    assert kw["add_qkv_bias"] is True
    assert "qk_layernorm" not in kw
    assert kw["num_moe_experts"] == 6 == args.num_experts
    assert kw["moe_router_topk"] == 3
    assert kw["moe_ffn_hidden_size"] == 48
    assert kw["ffn_hidden_size"] == 200                          # the dense layers of mlp_only_layers
    assert kw["moe_aux_loss_coeff"] == pytest.approx(0.0123)
    assert kw["moe_router_pre_softmax"] is True                  # softmax, top-k, no renormalisation
    assert kw["moe_layer_freq"] == [0, 0, 0, 1, 0, 1]
    assert kw["moe_shared_expert_intermediate_size"] == 56
    assert kw["moe_shared_expert_gate"] is True
    assert not MLA_FIELDS & set(kw)


def test_qwen2_moe_options():
    kw = megatron_args_from_hf(qwen2_moe(qkv_bias=False, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[])).config_kwargs
    assert kw["add_qkv_bias"] is False
    assert kw["moe_router_pre_softmax"] is False
    assert kw["moe_layer_freq"] == [1] * 6
    for shared in (56, 0):  # no experts: every layer a dense MLP, as in transformers, and no shared expert
        args = megatron_args_from_hf(qwen2_moe(num_experts=0, shared_expert_intermediate_size=shared))
        assert args.num_experts is None
        assert not MOE_FIELDS & set(args.config_kwargs), MOE_FIELDS & set(args.config_kwargs)
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size=0"):
        megatron_args_from_hf(qwen2_moe(shared_expert_intermediate_size=0))


def test_glm4_moe_mapping():
    hf = glm4_moe()
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    kw = args.config_kwargs
    assert args.mla is False and not MLA_FIELDS & set(kw)
    assert kw["kv_channels"] == 96 // 6 and kw["num_query_groups"] == 2   # GQA, not MLA
    assert kw["add_qkv_bias"] is True                                     # q/k/v only; o_proj never
    assert kw["qk_layernorm"] is True
    assert args.rotary_percent == 0.25 == hf["rope_parameters"]["partial_rotary_factor"]
    assert kw["num_moe_experts"] == 8 == args.num_experts
    assert kw["moe_router_topk"] == 4
    assert kw["moe_ffn_hidden_size"] == 36
    assert kw["ffn_hidden_size"] == 200                                  # the first_k_dense_replace layers
    assert kw["moe_shared_expert_intermediate_size"] == 2 * 36
    assert "moe_shared_expert_gate" not in kw
    assert kw["moe_layer_freq"] == [0, 0, 1, 1, 1]
    assert kw["moe_router_score_function"] == "sigmoid"
    assert kw["moe_router_enable_expert_bias"] is True
    assert kw["moe_router_topk_scaling_factor"] == 1.75
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (4, 2)
    assert kw["moe_router_dtype"] == "fp32"
    assert kw["moe_aux_loss_coeff"] == 0.0                               # Glm4Moe has no aux loss


def test_glm4_moe_options():
    kw = megatron_args_from_hf(glm4_moe(attention_bias=False, use_qk_norm=False, n_group=1, topk_group=1)).config_kwargs
    assert kw["add_qkv_bias"] is False and kw["qk_layernorm"] is False
    assert "moe_router_num_groups" not in kw and "moe_router_group_topk" not in kw
    with pytest.raises(UnsupportedModelError, match="n_shared_experts=0"):
        megatron_args_from_hf(glm4_moe(n_shared_experts=0))


@pytest.mark.parametrize("where,expected", [
    ({}, 0.5),                                                             # Glm4MoeConfig's default
    ({"partial_rotary_factor": 0.25}, 0.25),                               # hub style: a top-level key
    ({"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 1.0}, "partial_rotary_factor": 0.5}, 1.0),
])
def test_glm4_moe_partial_rotary_factor_as_transformers_reads_it(where, expected):
    hf = {k: v for k, v in glm4_moe().items() if k not in ("partial_rotary_factor", "rope_parameters")}
    hf.update(where)
    assert megatron_args_from_hf(hf).rotary_percent == expected
    assert transformers.Glm4MoeConfig(**hf).rope_parameters["partial_rotary_factor"] == expected
    assert megatron_args_from_hf(llama()).rotary_percent == 1.0


def test_glm4_moe_partial_rope_matches_megatron_rotary_percent():
    """transformers' Glm4Moe rope (the first int(head_dim * factor) channels, rotate_half within
    them) equals Megatron's RotaryEmbedding(rotary_percent) + apply_rotary_pos_emb."""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    hf = glm4_moe(partial_rotary_factor=0.25, head_dim=32)
    config = transformers.Glm4MoeConfig(**hf)
    seq, heads, dim = 11, 3, 32
    torch.manual_seed(0)
    q = torch.randn(1, heads, seq, dim, dtype=torch.float64)
    cos, sin = glm.Glm4MoeRotaryEmbedding(config)(q, torch.arange(seq)[None])
    expected, _ = glm.apply_rotary_pos_emb(q, q, cos.double(), sin.double())
    args = megatron_args_from_hf(hf)
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=args.rotary_percent,
                           rotary_base=args.config_kwargs["rotary_base"], use_cpu_initialization=True)
    half = rope.get_freqs_non_repeated(seq).double()  # get_emb without its move to the GPU
    freqs = torch.cat((half, half), dim=-1)[:, None, None, :]  # [seq, 1, 1, rotary dim], not interleaved
    assert freqs.shape[-1] == int(dim * 0.25)
    got = _apply_rotary_pos_emb_bshd(q.permute(2, 0, 1, 3), freqs).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(got[..., 8:], q[..., 8:])  # the rest passes unrotated


def test_glm4_moe_partial_rope_with_scaling_is_refused():
    hf = glm4_moe(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                   "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5"):
        megatron_args_from_hf(hf)


def test_gpt_oss_mapping():
    hf = gpt_oss()
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    kw = args.config_kwargs
    assert kw["num_moe_experts"] == 6 == args.num_experts
    assert kw["moe_router_topk"] == 3
    assert kw["moe_ffn_hidden_size"] == 200                      # GptOss's intermediate_size is the expert's
    assert kw["moe_layer_freq"] == [1] * 4
    assert kw["moe_router_pre_softmax"] is False                 # top-k logits, then their softmax
    assert kw["moe_aux_loss_coeff"] == pytest.approx(0.0123)
    assert kw["add_qkv_bias"] is True and kw["add_bias_linear"] is True
    assert kw["softmax_type"] == "learnable"
    assert kw["window_size"] == (23, 0)                           # HF's window W: the W latest keys
    assert kw["window_attn_skip_freq"] == [1, 0, 0, 1]
    assert kw["activation_func"] == "quick_gelu"
    assert kw["activation_func_clamp_value"] == 5.5
    assert kw["glu_linear_offset"] == 1.0
    assert not MLA_FIELDS & set(kw) and not args.mla


def test_gpt_oss_default_layer_types_and_no_window():
    hf = gpt_oss(layer_types=None)
    assert hf["layer_types"] == ["sliding_attention", "full_attention"] * 2  # transformers' default
    assert megatron_args_from_hf(hf).config_kwargs["window_attn_skip_freq"] == [1, 0, 1, 0]
    kw = megatron_args_from_hf(gpt_oss(layer_types=["full_attention"] * 4)).config_kwargs
    assert "window_size" not in kw and "window_attn_skip_freq" not in kw


@pytest.mark.parametrize("field,value", [("swiglu_alpha", 1.5), ("attention_bias", False),
                                         ("num_experts_per_tok", 1)])
def test_gpt_oss_settings_megatron_cannot_reproduce_are_refused_by_name(field, value):
    with pytest.raises(UnsupportedModelError, match=field):
        megatron_args_from_hf(gpt_oss(**{field: value}))


def test_gpt_oss_yarn():
    """transformers' GptOss default rope (gpt-oss-20b's): YaRN, untruncated; Megatron's GPT YaRN
    embedding takes it through yarn_* attributes (no TransformerConfig fields)."""
    hf = gpt_oss(rope_parameters=None)
    assert hf["rope_parameters"]["rope_type"] == "yarn" and hf["rope_parameters"]["truncate"] is False
    args = megatron_args_from_hf(hf)
    assert args.yarn == {"yarn_rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
                         "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": None,
                         "yarn_mscale_all_dim": None, "yarn_correction_range_round_to_int": False}
    assert args.config_kwargs["rotary_base"] == hf["rope_parameters"]["rope_theta"]
    assert args.rope_scaling is None and not set(args.yarn) & set(args.config_kwargs)
    both = megatron_args_from_hf(gpt_oss(rope_parameters={**hf["rope_parameters"], "mscale": 0.7,
                                                          "mscale_all_dim": 0.5})).yarn
    assert (both["yarn_mscale"], both["yarn_mscale_all_dim"]) == (0.7, 0.5)
    one = megatron_args_from_hf(gpt_oss(rope_parameters={**hf["rope_parameters"], "mscale": 0.7})).yarn
    assert one["yarn_mscale"] is None  # transformers uses the ratio only when both are set
    assert megatron_args_from_hf(llama()).yarn is None


def test_gpt_oss_openai_keys_transformers_ignores_are_inert():
    import warnings

    hf = {**gpt_oss(), "experts_per_token": 3, "initial_context_length": 4096}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert megatron_args_from_hf(hf).config_kwargs["moe_router_topk"] == 3


@pytest.mark.parametrize("extra", [{"attention_factor": 1.0}, {"partial_rotary_factor": 0.5},
                                   {"rope_type": "dynamic"}])
def test_gpt_oss_rope_megatron_cannot_reproduce_is_refused_by_name(extra):
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedModelError, match="config field rope_parameters="):
        megatron_args_from_hf(gpt_oss(rope_parameters={**rope, **extra}))


def test_mistral_mapping():
    hf = mistral()
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    check_dense(args)
    kw = args.config_kwargs
    assert kw["kv_channels"] == 32 != 96 // 6
    assert kw["add_qkv_bias"] is False
    assert "qk_layernorm" not in kw
    assert megatron_args_from_hf(mistral(head_dim=None)).config_kwargs["kv_channels"] == 96 // 6


@pytest.mark.parametrize("window", [None, 777, 4096])
def test_mistral_sliding_window_without_effect_is_accepted(window):
    """A window of at least max_position_embeddings (777 here) never drops a key."""
    assert megatron_args_from_hf(mistral(sliding_window=window)).config_kwargs == \
        megatron_args_from_hf(mistral()).config_kwargs


@pytest.mark.parametrize("window", [776, 16, 1])
def test_mistral_sliding_window_maps_to_window_size(window):
    """transformers' query i sees keys i-W+1..i (kv_idx > q_idx - W): Megatron's (W-1, 0), every layer."""
    kw = megatron_args_from_hf(mistral(sliding_window=window)).config_kwargs
    assert kw["window_size"] == (window - 1, 0)
    assert "window_attn_skip_freq" not in kw  # None: Megatron slides every layer


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_mistral_bad_sliding_window_is_refused_by_name(window):
    hf = {**mistral(), "sliding_window": window}  # as a hand-written config.json may read
    with pytest.raises(UnsupportedModelError, match=f"sliding_window={window!r} is not supported"):
        megatron_args_from_hf(hf)


def test_sliding_window_under_transformer_engine_is_refused(monkeypatch):
    """TE's window semantics are unchecked here (no GPU): refused by name, not run."""
    from types import SimpleNamespace

    from megarl.config import ModelConfig
    from megarl.models import builder
    from megarl.parallel.layout import Layout

    monkeypatch.setattr(builder, "resolve_impl", lambda impl: True)
    args = megatron_args_from_hf(mistral(sliding_window=16))
    with pytest.raises(UnsupportedModelError, match="sliding window .*Transformer Engine.*transformer_impl=local"):
        builder.transformer_config(args, SimpleNamespace(layout=Layout(tp=1, pp=1, dp=1)), ModelConfig())


def test_mixtral_mapping():
    hf = mixtral()
    assert "norm_topk_prob" not in hf
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    kw = args.config_kwargs
    assert kw["kv_channels"] == 96 // 6                          # head_dim is None in the file
    assert kw["rotary_base"] == 1e6
    assert kw["num_moe_experts"] == 5
    assert kw["moe_router_topk"] == 2
    assert kw["moe_ffn_hidden_size"] == hf["intermediate_size"] == 200
    assert kw["moe_router_pre_softmax"] is False                 # mixtral renormalises the top-k
    assert kw["moe_layer_freq"] == [1, 1, 1]
    assert kw["moe_aux_loss_coeff"] == pytest.approx(0.0321)
    assert "qk_layernorm" not in kw
    assert kw["add_qkv_bias"] is False


def test_deepseek_v3_mapping():
    hf = deepseek_v3()
    args = megatron_args_from_hf(hf)
    kw = args.config_kwargs
    assert args.mla is True
    assert kw["num_layers"] == 5
    assert kw["hidden_size"] == 96
    assert kw["ffn_hidden_size"] == 200
    assert kw["num_attention_heads"] == 6
    assert kw["num_query_groups"] == 6
    assert kw["kv_channels"] == 20                               # v_head_dim
    assert kw["layernorm_epsilon"] == 3e-5
    assert kw["rotary_base"] == 123456.0
    assert kw["rope_type"] == "rope"
    assert kw["qk_layernorm"] is True
    assert kw["q_lora_rank"] == 48
    assert kw["kv_lora_rank"] == 40
    assert kw["qk_head_dim"] == 24
    assert kw["qk_pos_emb_head_dim"] == 12
    assert kw["v_head_dim"] == 20
    assert kw["num_moe_experts"] == 8 == args.num_experts
    assert kw["moe_router_topk"] == 4
    assert kw["moe_ffn_hidden_size"] == 36
    assert kw["moe_shared_expert_intermediate_size"] == 2 * 36
    assert kw["moe_layer_freq"] == [0, 0, 1, 1, 1]               # first_k_dense_replace=2
    assert kw["moe_router_score_function"] == "sigmoid"
    assert kw["moe_router_enable_expert_bias"] is True
    assert kw["moe_router_topk_scaling_factor"] == 1.75
    assert kw["moe_router_num_groups"] == 4
    assert kw["moe_router_group_topk"] == 2
    assert args.vocab_size == 1000
    assert args.tie_word_embeddings is False
    assert args.max_position_embeddings == 777


@pytest.mark.parametrize("key,value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                       ("moe_layer_freq", 2)])
def test_deepseek_v3_keys_transformers_ignores_are_refused_unless_its_behaviour(key, value):
    # DeepSeek's own config.json keys: transformers' DeepseekV3 always routes on sigmoid scores
    # with e_score_correction_bias and makes every layer past first_k_dense_replace MoE.
    hf = deepseek_v3()
    assert megatron_args_from_hf({**hf, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                                  "moe_layer_freq": 1}).config_kwargs == megatron_args_from_hf(hf).config_kwargs
    with pytest.raises(UnsupportedModelError, match=f"{key}={value!r}"):
        megatron_args_from_hf({**hf, key: value})


def test_deepseek_v3_q_lora_rank_null_reaches_megatron():
    # Megatron's MLATransformerConfig defaults q_lora_rank to 512: a null must be passed through.
    kw = megatron_args_from_hf(deepseek_v3(q_lora_rank=None)).config_kwargs
    assert "q_lora_rank" in kw and kw["q_lora_rank"] is None


@pytest.mark.parametrize("n_group,topk_group,topk,groups", [
    (4, 2, 4, (4, 2)),    # top-k // topk_group == 2: Megatron and transformers score groups alike
    (1, 1, 3, None),      # one group: no group limit
    (4, 4, 3, None),      # every group kept: no group limit
])
def test_deepseek_v3_group_routing_mapped(n_group, topk_group, topk, groups):
    kw = megatron_args_from_hf(deepseek_v3(n_group=n_group, topk_group=topk_group,
                                           num_experts_per_tok=topk)).config_kwargs
    assert (kw.get("moe_router_num_groups"), kw.get("moe_router_group_topk")) == (groups or (None, None))


@pytest.mark.parametrize("n_group,topk_group,topk", [(4, 2, 2), (4, 2, 6), (8, 4, 4), (4, 1, 3)])
def test_deepseek_v3_group_routing_megatron_scores_differently_is_refused(n_group, topk_group, topk):
    with pytest.raises(UnsupportedModelError, match="n_group") as err:
        megatron_args_from_hf(deepseek_v3(n_group=n_group, topk_group=topk_group, num_experts_per_tok=topk))
    assert "top 2" in str(err.value)


@pytest.mark.parametrize("norm,topk,ok", [(True, 4, True), (False, 4, False), (False, 1, True), (True, 1, False)])
def test_deepseek_v3_norm_topk_prob(norm, topk, ok):
    # Megatron renormalises sigmoid top-k scores exactly when top_k > 1.
    hf = deepseek_v3(norm_topk_prob=norm, num_experts_per_tok=topk, n_group=1, topk_group=1)
    if ok:
        assert megatron_args_from_hf(hf).config_kwargs["moe_router_topk"] == topk
    else:
        with pytest.raises(UnsupportedModelError, match=f"norm_topk_prob={norm}"):
            megatron_args_from_hf(hf)


def test_deepseek_v3_yarn():
    hf = deepseek_v3()
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    kw = megatron_args_from_hf(hf).config_kwargs
    assert kw["rope_type"] == "yarn"
    assert kw["rotary_scaling_factor"] == 40.0
    assert kw["original_max_position_embeddings"] == 4096
    assert kw["mscale_all_dim"] == 1.0


_DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("mscales", [
    {"mscale": 1.0, "mscale_all_dim": 1.0},    # DeepSeek-V3's, Kimi-K2's
    {"mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2's
    {"mscale": 0.707, "mscale_all_dim": 1.0},
    {},                                        # neither: cos/sin by 0.1·ln(factor)+1
    {"mscale": 0.707},                         # transformers ignores mscale alone
    {"mscale_all_dim": 1.0},                   # the softmax scaled, cos/sin by 0.1·ln(factor)+1
    {"mscale": 0.0, "mscale_all_dim": 0.707},
    {"mscale": None, "mscale_all_dim": None},
])
def test_deepseek_v3_yarn_scales_as_transformers(mscales):
    """MLA's two YaRN factors from the mapped fields, by Megatron's own functions (what
    MultiLatentAttention and YarnRotaryEmbedding compute), equal transformers' DeepseekV3: the
    cos/sin factor (its rope's attention_factor) and the softmax factor (yarn_apply_mscale)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor, _yarn_get_mscale,
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = transformers.DeepseekV3Config(**{**deepseek_v3(), "rope_parameters": {**_DSV3_YARN, **mscales}})
    _, cos_sin = ROPE_INIT_FUNCTIONS["yarn"](config)
    softmax = yarn_apply_mscale(config.rope_parameters, 1.0)
    kw = megatron_args_from_hf(config.to_dict()).config_kwargs
    assert kw["rope_type"] == "yarn"
    assert _yarn_get_concentration_factor(kw["rotary_scaling_factor"], kw["mscale"], kw["mscale_all_dim"]) == \
        pytest.approx(cos_sin, rel=1e-12)
    assert _yarn_get_mscale(kw["rotary_scaling_factor"], kw["mscale_all_dim"]) ** 2 == pytest.approx(softmax, rel=1e-12)
    assert (cos_sin, softmax) != (1.0, 1.0)  # each case scales one or the other


def test_deepseek_v3_yarn_defaults_as_transformers():
    """beta_fast/beta_slow null read as 32/1, an absent original_max_position_embeddings as
    max_position_embeddings (transformers fills it in)."""
    hf = deepseek_v3()
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": None,
                             "beta_slow": None}
    kw = megatron_args_from_hf(hf).config_kwargs
    assert (kw["beta_fast"], kw["beta_slow"], kw["original_max_position_embeddings"]) == (32.0, 1.0, 777)


@pytest.mark.parametrize("extra", [{"attention_factor": 1.2}, {"truncate": False}])
def test_deepseek_v3_yarn_megatron_cannot_reproduce_is_refused_by_name(extra):
    """Megatron's MLA YaRN takes no attention factor of its own and always rounds the
    correction range (transformers' truncate)."""
    hf = deepseek_v3()
    hf["rope_parameters"] = {**_DSV3_YARN, "mscale": 1.0, "mscale_all_dim": 1.0, **extra}
    with pytest.raises(UnsupportedModelError, match="config field rope_parameters="):
        megatron_args_from_hf(hf)
    hf["rope_parameters"] = {**hf["rope_parameters"], "truncate": True, "attention_factor": None}
    assert megatron_args_from_hf(hf).config_kwargs["rope_type"] == "yarn"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_unsupported_model_type():
    with pytest.raises(UnsupportedModelError) as err:
        megatron_args_from_hf({**llama(), "model_type": "gpt2"})
    message = str(err.value)
    assert "gpt2" in message
    for name in FAMILIES:
        assert name in message
    assert isinstance(err.value, ValueError)


def test_unsupported_hidden_act():
    with pytest.raises(UnsupportedModelError, match="hidden_act") as err:
        megatron_args_from_hf(llama(hidden_act="gelu"))
    assert "gelu" in str(err.value)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "deepseek_v3"])
def test_unsupported_rope_type(model_type):
    hf = BUILDERS[model_type]()
    hf["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="rope_type") as err:
        megatron_args_from_hf(hf)
    assert "dynamic" in str(err.value)


def test_old_style_rope_scaling_type_key():
    hf = llama()
    del hf["rope_parameters"]
    hf["rope_theta"] = 10000.0
    hf["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="linear"):
        megatron_args_from_hf(hf)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_missing_required_key(model_type):
    hf = BUILDERS[model_type]()
    del hf["num_hidden_layers"]
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        megatron_args_from_hf(hf)


def test_missing_deepseek_key():
    hf = deepseek_v3()
    del hf["kv_lora_rank"]
    with pytest.raises(UnsupportedModelError, match="kv_lora_rank"):
        megatron_args_from_hf(hf)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        megatron_args_from_hf(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError):
        megatron_args_from_hf(tmp_path)                          # directory without config.json


# ---------------------------------------------------------------------------------------------
# Misc
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab,multiple,expected", [
    (250, 128, 256), (256, 128, 256), (257, 128, 384), (1, 128, 128), (151936, 128, 151936),
    (32000, 1, 32000), (50257, 64, 50304),
])
def test_padded_vocab_size(vocab, multiple, expected):
    assert padded_vocab_size(vocab, multiple) == expected


def test_read_from_directory_file_and_dict(tmp_path):
    hf = json.loads(json.dumps(qwen3_moe()))  # as a config.json reads back (string id2label keys)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from_dir = megatron_args_from_hf(tmp_path)
    from_dir_str = megatron_args_from_hf(str(tmp_path))
    from_file = megatron_args_from_hf(tmp_path / "config.json")
    from_dict = megatron_args_from_hf(hf)
    assert from_dir == from_file == from_dict == from_dir_str
    assert from_dict.config_kwargs["moe_layer_freq"] == [0, 0, 0, 1, 0, 1]


def test_input_dict_not_mutated():
    hf = json.loads(json.dumps(deepseek_v3()))
    snapshot = json.loads(json.dumps(hf))
    megatron_args_from_hf(hf)
    assert hf == snapshot


def test_architectures_are_the_families():
    assert set(ARCHITECTURES) == FAMILIES
    assert [t for t, a in ARCHITECTURES.items() if a.mla] == ["deepseek_v3"]
    assert set(MOE) <= MOE_FIELDS


def test_repo_model_configs_cover_all_architectures():
    assert len(MODEL_CONFIGS) >= len(FAMILIES)
    types = {json.loads(p.read_text())["model_type"] for p in MODEL_CONFIGS}
    assert types == FAMILIES


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=[p.stem for p in MODEL_CONFIGS])
def test_repo_model_config_maps(path):
    hf = json.loads(path.read_text())
    args = megatron_args_from_hf(path)
    assert args == megatron_args_from_hf(hf)
    kw = args.config_kwargs
    assert kw["num_layers"] == hf["num_hidden_layers"]
    assert kw["hidden_size"] == hf["hidden_size"]
    assert kw["num_attention_heads"] == hf["num_attention_heads"]
    assert args.vocab_size == hf["vocab_size"]
    moe = hf["model_type"] in {"mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text"}
    if moe:
        assert kw["num_moe_experts"] == (hf.get("num_local_experts") or hf.get("num_experts")
                                         or hf.get("n_routed_experts"))
        assert len(kw["moe_layer_freq"]) == hf["num_hidden_layers"]
    else:
        check_dense(args)


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=[p.stem for p in MODEL_CONFIGS])
def test_repo_model_config_builds_megatron_config(path):
    """The mapped field names are real Megatron TransformerConfig / MLATransformerConfig fields."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    args = megatron_args_from_hf(path)
    kw = dict(args.config_kwargs)
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if not args.mla:
        kw.pop("rotary_base")  # a GPTModel argument outside MLA
    activation = {"silu": F.silu, "quick_gelu": quick_gelu}[kw.pop("activation_func", "silu")]
    bias = kw.pop("add_bias_linear", False)
    cls = MLATransformerConfig if args.mla else TransformerConfig
    config = cls(**kw, use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
                 add_bias_linear=bias, activation_func=activation)
    assert config.num_layers == args.config_kwargs["num_layers"]
    assert config.num_moe_experts == args.num_experts


def test_qwen3_next_mapping():
    hf = qwen3_next()
    args = megatron_args_from_hf(hf)
    check_common(args, hf)
    kw = args.config_kwargs
    assert kw["experimental_attention_variant"] == "gated_delta_net"
    assert kw["linear_attention_freq"] == [1, 1, 0, 1, 1, 0]                 # 1: a gated delta net
    assert (kw["linear_conv_kernel_dim"], kw["linear_key_head_dim"], kw["linear_value_head_dim"]) == (3, 12, 20)
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"]) == (2, 6)
    assert kw["attention_output_gate"] is True and kw["qk_layernorm"] is True
    assert kw["layernorm_zero_centered_gamma"] is True and kw["add_qkv_bias"] is False
    assert args.rotary_percent == 0.375
    assert kw["num_moe_experts"] == 6 and kw["moe_router_topk"] == 3 and kw["moe_ffn_hidden_size"] == 48
    assert kw["moe_layer_freq"] == [1, 0, 1, 1, 1, 1]
    assert kw["moe_shared_expert_intermediate_size"] == 56 and kw["moe_shared_expert_gate"] is True
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob (default true): top-k, then renormalised


def test_qwen3_next_full_attention_interval_without_layer_types():
    """Qwen3-Next-80B's own config.json has full_attention_interval and no layer_types:
    every interval-th layer attends fully, as transformers derives it."""
    hf = {k: v for k, v in qwen3_next(num_hidden_layers=8, layer_types=None).items() if k != "layer_types"}
    hf["full_attention_interval"] = 4
    assert megatron_args_from_hf(hf).config_kwargs["linear_attention_freq"] == [1, 1, 1, 0] * 2
    assert transformers.Qwen3NextConfig(num_hidden_layers=8).layer_types == ["linear_attention"] * 3 + [
        "full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


def test_qwen3_5_moe_text_mapping_and_its_wrapper():
    hf = qwen3_5_moe_text()
    assert "intermediate_size" not in hf and "norm_topk_prob" not in hf and "mlp_only_layers" not in hf
    args = megatron_args_from_hf(hf)
    kw = args.config_kwargs
    assert kw["linear_attention_freq"] == [1, 0, 1, 0] and kw["moe_layer_freq"] == [1] * 4
    assert kw["moe_router_pre_softmax"] is False  # transformers' Qwen3.5 router always renormalises its top-k
    assert kw["ffn_hidden_size"] == 48 and args.rotary_percent == 0.25
    wrapped = transformers.Qwen3_5MoeConfig(text_config=hf, tie_word_embeddings=False).to_dict()
    inner = megatron_args_from_hf(wrapped)
    assert inner.config_kwargs == kw and inner.hf_config == wrapped and inner.hf_prefix == "model.language_model."
