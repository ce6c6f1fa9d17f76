"""Hugging Face ``config.json`` → Megatron ``TransformerConfig`` and ``GPTModel`` arguments.

One declarative table per architecture (``ARCHITECTURES``): each row maps a Megatron field to
an HF key or to a small function of the HF config. Common rows are shared; an architecture
lists only what differs. A second table (``FIELDS``) classifies every field of the HF config:
mapped, inert (no effect on the math), or honoured only at some values (:class:`Only`), so a
setting megarl cannot reproduce is refused by name before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

Row = Union[str, Callable[[Mapping[str, Any]], Any]]


class UnsupportedModelError(ValueError):
    """The HF config asks for something megarl cannot build."""


def _get(hf: Mapping[str, Any], *keys, default=None):
    for key in keys:
        if key in hf and hf[key] is not None:
            return hf[key]
    return default


def _head_dim(hf) -> int:
    return _get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"])


def _rope(hf) -> Dict[str, Any]:
    # transformers >= 5 keeps rope settings in ``rope_parameters``; older files use
    # ``rope_theta`` + ``rope_scaling``.
    params = dict(_get(hf, "rope_parameters", "rope_scaling", default={}) or {})
    params.setdefault("rope_theta", _get(hf, "rope_theta", default=10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _moe_layer_freq(hf) -> list:
    n = hf["num_hidden_layers"]
    if "first_k_dense_replace" in hf:  # DeepSeek-V3: the first k layers are dense, the rest MoE
        k = hf["first_k_dense_replace"]
        return [1 if i >= k else 0 for i in range(n)]
    dense_only = set(_get(hf, "mlp_only_layers", default=[]))
    step = _get(hf, "decoder_sparse_step", default=1)
    return [0 if (i in dense_only or (i + 1) % step) else 1 for i in range(n)]


COMMON: Dict[str, Row] = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": lambda hf: _get(hf, "num_key_value_heads", default=hf["num_attention_heads"]),
    "kv_channels": _head_dim,
    "layernorm_epsilon": lambda hf: _get(hf, "rms_norm_eps", default=1e-6),
    "init_method_std": lambda hf: _get(hf, "initializer_range", default=0.02),
    "attention_dropout": lambda hf: float(_get(hf, "attention_dropout", default=0.0)),
    "add_qkv_bias": lambda hf: False,
    "rotary_base": lambda hf: _rope(hf)["rope_theta"],
}

MOE: Dict[str, Row] = {
    "num_moe_experts": lambda hf: _get(hf, "num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": lambda hf: _get(hf, "moe_intermediate_size", "intermediate_size"),
    "moe_layer_freq": _moe_layer_freq,
    # softmax over all experts then top-k and renormalise == top-k then softmax (pre_softmax False);
    # a missing norm_topk_prob is Qwen3-MoE's default, false
    "moe_router_pre_softmax": lambda hf: not _get(hf, "norm_topk_prob", default=False),
    "moe_aux_loss_coeff": lambda hf: float(_get(hf, "router_aux_loss_coef", default=0.0)),
}


def _group_limit_is_noop(hf) -> bool:
    """Every group is kept (``topk_group >= n_group``, e.g. n_group=1): plain top-k routing."""
    return hf["topk_group"] >= hf["n_group"]


# DeepSeek-V3's routing (shared by GLM-4.5): sigmoid scores plus e_score_correction_bias (Megatron's
# router expert_bias) choose the experts, routed_scaling_factor scales their weights, optionally
# group-limited; n_shared_experts shared experts of moe_intermediate_size each.
SIGMOID_MOE: Dict[str, Row] = {
    **MOE,
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_shared_expert_intermediate_size": lambda hf: hf["n_shared_experts"] * hf["moe_intermediate_size"],
    # transformers' DeepseekV3 and Glm4Moe always route on sigmoid scores plus
    # e_score_correction_bias (DeepSeek's scoring_func / topk_method otherwise are refused in FIELDS).
    "moe_router_score_function": lambda hf: "sigmoid",
    "moe_router_enable_expert_bias": lambda hf: True,
    "moe_router_topk_scaling_factor": lambda hf: _get(hf, "routed_scaling_factor", default=1.0),
    "moe_router_num_groups": lambda hf: None if _group_limit_is_noop(hf) else hf["n_group"],
    "moe_router_group_topk": lambda hf: None if _group_limit_is_noop(hf) else hf["topk_group"],
    "moe_router_pre_softmax": lambda hf: True,
    "moe_router_dtype": lambda hf: "fp32",
    "moe_router_bias_update_rate": lambda hf: 1e-3,  # DeepSeek-V3's; the builder sets model.moe_router_bias_update_rate
}

DEEPSEEK_V3: Dict[str, Row] = {
    **SIGMOID_MOE,
    "q_lora_rank": "q_lora_rank",  # null: a plain q_proj (DeepSeek-V2-Lite, Moonlight); see KEEP_NULL
    "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "qk_layernorm": lambda hf: True,  # q_a_layernorm / kv_a_layernorm
    "num_query_groups": "num_attention_heads",
    "kv_channels": "v_head_dim",
}
# Rows whose null is meaningful and must reach Megatron (its default would differ).
KEEP_NULL = {"q_lora_rank"}

QWEN2_MOE: Dict[str, Row] = {
    **MOE,
    "add_qkv_bias": lambda hf: bool(_get(hf, "qkv_bias", default=True)),
    # one shared expert, its output scaled by sigmoid(shared_expert_gate(x)): Megatron's gate
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "moe_shared_expert_gate": lambda hf: True,
}


GLM4_MOE: Dict[str, Row] = {
    **SIGMOID_MOE,
    # transformers' Glm4Moe biases q/k/v by attention_bias and never o_proj
    "add_qkv_bias": lambda hf: bool(_get(hf, "attention_bias", default=False)),
    # per-head RMSNorm (of head_dim) on q and k before the rope, as Megatron's qk_layernorm
    "qk_layernorm": lambda hf: bool(_get(hf, "use_qk_norm", default=False)),
}


def _partial_rotary_factor(hf) -> float:
    """GLM-4.5 rotates the first ``int(head_dim * factor)`` channels of each head (half-split
    rotate_half within them) and passes the rest; Megatron's ``rotary_percent`` does exactly that
    (RotaryEmbedding, rope_utils._apply_rotary_pos_emb_bshd). transformers reads the factor from
    rope_parameters, which takes a top-level partial_rotary_factor when it has none; Glm4MoeConfig
    defaults it to 0.5."""
    return float(_get(_rope(hf), "partial_rotary_factor", default=_get(hf, "partial_rotary_factor", default=0.5)))


def _sliding(hf) -> list:
    """1 for each layer transformers' GptOss slides (``layer_types``; by default the 1st, 3rd, ...)."""
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(hf["num_hidden_layers"])]
    return [1 if t == "sliding_attention" else 0 for t in types]


def _gpt_oss_window(hf):
    """HF's sliding_window W lets query i see keys i-W+1..i (masking_utils: kv > q - W):
    Megatron's window_size (W-1, 0) on the layers ``window_attn_skip_freq`` marks 1."""
    if hf.get("sliding_window") is None or not any(_sliding(hf)):
        return None
    return (hf["sliding_window"] - 1, 0)


GPT_OSS: Dict[str, Row] = {
    **MOE,
    "moe_ffn_hidden_size": "intermediate_size",
    "moe_layer_freq": lambda hf: [1] * hf["num_hidden_layers"],
    # transformers' GptOss: top-k of the router's logits, then a softmax over those k
    "moe_router_pre_softmax": lambda hf: False,
    "add_qkv_bias": lambda hf: True,
    "add_bias_linear": lambda hf: True,  # q/k/v/o, the router and the experts all carry a bias
    "softmax_type": lambda hf: "learnable",  # self_attn.sinks: one sink logit per head
    "window_size": _gpt_oss_window,
    "window_attn_skip_freq": lambda hf: _sliding(hf) if _gpt_oss_window(hf) else None,
    # experts: gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate * sigmoid(1.702 gate)
    "activation_func": lambda hf: "quick_gelu",
    "activation_func_clamp_value": lambda hf: float(hf["swiglu_limit"]),
    "glu_linear_offset": lambda hf: 1.0,
}


def _mistral_window(hf):
    """transformers' Mistral slides every layer by ``sliding_window`` W: query i sees keys
    i-W+1..i (masking_utils.sliding_window_overlay: ``kv_idx > q_idx - W``), Megatron's
    ``window_size=(W-1, 0)``. None (full attention) when W is null or covers
    max_position_embeddings, the longest sequence megarl runs."""
    window = hf.get("sliding_window")
    if window is None or window >= _get(hf, "max_position_embeddings", default=4096):
        return None
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"mistral config field sliding_window={window!r} is not supported: "
                                    "a positive integer or null")
    return (window - 1, 0)


def _linear_layers(hf) -> list:
    """1 for each gated-delta-net layer of a hybrid Qwen (``layer_types``, else every layer but
    each ``full_attention_interval``-th, transformers' default), 0 for full attention."""
    n = hf["num_hidden_layers"]
    interval = _get(hf, "full_attention_interval", default=4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(n)]
    return [1 if t == "linear_attention" else 0 for t in types]


# Qwen3-Next and the Qwen3.5 text models: gated delta nets interleaved with gated full attention
# (q_proj's second half per head gates the output: Megatron's attention_output_gate), every norm
# zero-centred (1 + w) but the delta net's gated output norm (see hf_mapping.ZeroCentred), a
# softmax router (Qwen3-MoE's) and one shared expert with a sigmoid gate (Qwen2-MoE's).
QWEN3_NEXT: Dict[str, Row] = {
    **QWEN2_MOE,
    "add_qkv_bias": lambda hf: False,  # attention_bias (q/k/v and o) is refused in FIELDS
    "qk_layernorm": lambda hf: True,
    "layernorm_zero_centered_gamma": lambda hf: True,
    "attention_output_gate": lambda hf: True,
    "experimental_attention_variant": lambda hf: "gated_delta_net",
    "linear_attention_freq": _linear_layers,
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
}


# The Qwen3.5 MoE text models (Qwen3_5MoeForCausalLM): Qwen3-Next's layers with the delta net's
# projections kept apart (hf_mapping.DeltaNetInProj, grouped=False), every layer MoE, the router
# always renormalising its top-k, no dense intermediate size.
QWEN3_5_MOE: Dict[str, Row] = {
    **QWEN3_NEXT,
    "ffn_hidden_size": lambda hf: _get(hf, "intermediate_size", default=hf["moe_intermediate_size"]),
    "moe_layer_freq": lambda hf: [1] * hf["num_hidden_layers"],
    "moe_router_pre_softmax": lambda hf: False,
}


def _qwen3_next_rotary(hf) -> float:
    """transformers' Qwen3-Next/Qwen3.5 rotate the first ``partial_rotary_factor`` of each head
    (default 0.25), as GLM-4.5 does (:func:`_partial_rotary_factor`)."""
    return float(_get(_rope(hf), "partial_rotary_factor", default=_get(hf, "partial_rotary_factor", default=0.25)))


@dataclass(frozen=True)
class Architecture:
    """How one HF ``model_type`` maps onto Megatron."""

    rows: Dict[str, Row]
    mla: bool = False
    # the fraction of each head's channels the rope rotates (a GPTModel argument); None: all
    rotary_percent: Optional[Callable[[Mapping[str, Any]], float]] = None


ARCHITECTURES: Dict[str, Architecture] = {
    "llama": Architecture(COMMON),
    "mistral": Architecture({**COMMON, "window_size": _mistral_window}),  # Llama's tensors
    "qwen2": Architecture({**COMMON, "add_qkv_bias": lambda hf: True}),
    "qwen3": Architecture({**COMMON, "qk_layernorm": lambda hf: True}),
    # transformers' Mixtral always renormalises the top-k (it has no norm_topk_prob)
    "mixtral": Architecture({**COMMON, **MOE, "moe_router_pre_softmax": lambda hf: False}),
    "qwen3_moe": Architecture({**COMMON, **MOE, "qk_layernorm": lambda hf: True}),
    "qwen2_moe": Architecture({**COMMON, **QWEN2_MOE}),
    "deepseek_v3": Architecture({**COMMON, **DEEPSEEK_V3}, mla=True),
    "glm4_moe": Architecture({**COMMON, **GLM4_MOE}, rotary_percent=_partial_rotary_factor),
    "qwen3_next": Architecture({**COMMON, **QWEN3_NEXT}, rotary_percent=_qwen3_next_rotary),
    "qwen3_5_moe_text": Architecture({**COMMON, **QWEN3_5_MOE}, rotary_percent=_qwen3_next_rotary),
    "gpt_oss": Architecture({**COMMON, **GPT_OSS, "layernorm_epsilon": lambda hf: _get(hf, "rms_norm_eps", default=1e-5)}),
}


@dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint whose text model megarl trains (Qwen3.5's vision-language MoE):
    ``text_config`` is read as ``text_model_type``; the text model's HF tensors carry ``prefix``
    where a text checkpoint has ``model.``; tensors under ``carried`` (the vision tower) are not
    trained, and an export copies them unchanged from the source (transformers' causal-LM class
    reads such a directory as its text model)."""

    text_model_type: str
    prefix: str
    carried: Tuple[str, ...]


WRAPPERS: Dict[str, Wrapper] = {
    "qwen3_5_moe": Wrapper("qwen3_5_moe_text", "model.language_model.", ("model.visual.",)),
}


# ----------------------------------------------------------------------------- config fields

MAPPED = "mapped"  # read into Megatron's config (the rows above, the rope and layer-pattern code)
INERT = "inert"  # no effect on the network's math (ids, output switches, the file's dtype, ...)


@dataclass(frozen=True)
class Only:
    """A field megarl honours only where ``ok(hf)`` holds; any other value is refused by name."""

    ok: Callable[[Mapping[str, Any]], bool]
    supported: str  # what megarl can run, i.e. what to change


def _at(key: str, *allowed) -> Callable[[Mapping[str, Any]], bool]:
    """``key`` is absent, null or one of ``allowed``."""
    return lambda hf: hf.get(key) is None or hf[key] in allowed


def _qwen_no_window(hf) -> bool:
    """No layer slides: transformers' Qwen2/Qwen3 use a window only with use_sliding_window, on
    the layers ``layer_types`` marks (by default those from max_window_layers on)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return True
    first = _get(hf, "max_window_layers", default=28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                       for i in range(hf["num_hidden_layers"])]
    return all(t == "full_attention" for t in types)


def _qwen2_moe_no_window(hf) -> bool:
    """As :func:`_qwen_no_window` for transformers' Qwen2-MoE, whose default ``layer_types``
    slide every other layer (the 1st, 3rd, ...) below max_window_layers."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return True
    below = _get(hf, "max_window_layers", default=28)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < below else "full_attention"
                                       for i in range(hf["num_hidden_layers"])]
    return all(t == "full_attention" for t in types)


def _shared_expert_ok(hf) -> bool:
    """transformers' Qwen2-MoE builds a shared expert (and its gate) in every MoE layer, one of
    intermediate size 0 too (zero-sized tensors): megarl maps only a real one."""
    return not _get(hf, "num_experts", default=0) or _get(hf, "shared_expert_intermediate_size", default=1) > 0


def _softmax_top1_ok(hf) -> bool:
    """Renormalised top-1 softmax routing weighs the chosen expert by exactly 1; Megatron refuses
    top-1 softmax routing without pre-softmax (TransformerConfig.__post_init__)."""
    experts = _get(hf, "num_local_experts", "num_experts", default=0)
    return not (experts and hf["num_experts_per_tok"] == 1 and _get(hf, "norm_topk_prob", default=False))


def _sigmoid_normalisation_ok(hf) -> bool:
    """Megatron renormalises sigmoid top-k scores exactly when top_k > 1
    (moe_utils.topk_routing_with_score_function); transformers' DeepseekV3 when norm_topk_prob."""
    return bool(_get(hf, "norm_topk_prob", default=True)) == (hf["num_experts_per_tok"] > 1)


def _group_scores_ok(hf) -> bool:
    """Megatron scores an expert group by the sum of its top ``top_k // topk_group`` scores
    (moe_utils.group_limited_topk), transformers' DeepseekV3 by its top 2: the same groups win
    when that is 2, or when every group is kept anyway."""
    return _group_limit_is_noop(hf) or hf["num_experts_per_tok"] // hf["topk_group"] == 2


def _gpt_oss_rope_ok(hf) -> bool:
    """Plain RoPE, or YaRN as Megatron's ``YarnRotaryEmbedding`` computes it: frequencies from
    factor, beta_fast/beta_slow (default 32/1), original_max_position_embeddings and truncate
    (``yarn_correction_range_round_to_int``); cos/sin scaled by 0.1·ln(factor)+1, or by the
    mscale/mscale_all_dim ratio where both are set, as transformers infers attention_factor."""
    rope = _rope(hf)
    if rope["rope_type"] == "default":
        return True
    return (rope["rope_type"] == "yarn" and rope.get("factor") is not None
            and rope.get("attention_factor") is None and float(rope.get("partial_rotary_factor", 1.0)) == 1.0
            and "original_max_position_embeddings" in rope)


def yarn_settings(hf) -> Dict[str, Any]:
    """Megatron's ``yarn_*`` settings of a GPT (non-MLA) model for an HF YaRN rope, exactly as
    transformers' ``_compute_yarn_parameters`` computes its frequencies and attention factor."""
    rope = _rope(hf)
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
    return {
        "yarn_rotary_scaling_factor": float(rope["factor"]),
        "yarn_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "yarn_beta_fast": float(rope.get("beta_fast") or 32),
        "yarn_beta_slow": float(rope.get("beta_slow") or 1),
        # None, None: Megatron's concentration factor is then 0.1·ln(factor)+1, transformers' default
        "yarn_mscale": float(rope["mscale"]) if both else None,
        "yarn_mscale_all_dim": float(rope["mscale_all_dim"]) if both else None,
        "yarn_correction_range_round_to_int": bool(rope.get("truncate", True)),
    }


_NO_WINDOW = ("megarl maps a sliding window for mistral only (this family's window layout is not "
              "checked against transformers); set use_sliding_window=false")
_TOP1_NORM = Only(_softmax_top1_ok, "with num_experts_per_tok=1, only false (Megatron cannot route "
                  "softmax top-1 with weight 1)")

BASE_FIELDS: Dict[str, Union[str, Only]] = {
    **{k: INERT for k in (
        "_name_or_path", "architectures", "auto_map", "chunk_size_feed_forward", "dtype", "torch_dtype",
        "id2label", "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states",
        "problem_type", "return_dict", "transformers_version", "bos_token_id", "eos_token_id",
        "pad_token_id", "use_cache")},
    **{k: MAPPED for k in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "initializer_range", "attention_dropout", "max_position_embeddings", "tie_word_embeddings",
        "rope_parameters", "rope_theta", "rope_scaling")},
    "hidden_act": Only(_at("hidden_act", "silu"), "only 'silu' (a SwiGLU MLP)"),
    # Megatron has one switch for every linear bias besides QKV; HF's attention_bias also puts
    # a bias on o_proj.
    "attention_bias": Only(_at("attention_bias", False), "Megatron cannot bias o_proj alone; only false"),
    "quantization_config": Only(_at("quantization_config"), "dequantize the checkpoint (e.g. to bf16) first"),
}

_QWEN_DENSE = {
    "sliding_window": Only(_qwen_no_window, _NO_WINDOW),
    "use_sliding_window": MAPPED, "max_window_layers": MAPPED, "layer_types": MAPPED,
}


def _mla_rope_ok(hf) -> bool:
    """Plain RoPE, or YaRN as Megatron's MLA computes it: its YaRN embedding always rounds the
    correction range to whole dimensions (transformers' ``truncate``, true by default) and takes
    its cos/sin factor from mscale/mscale_all_dim alone (no ``attention_factor``); other rope types
    are refused by name where the rope is read."""
    rope = _rope(hf)
    return rope["rope_type"] != "yarn" or (rope.get("attention_factor") is None
                                           and bool(rope.get("truncate", True)))


def mla_yarn_settings(hf) -> Dict[str, Any]:
    """MLATransformerConfig's YaRN fields for an HF YaRN rope, as transformers' DeepseekV3
    computes it. transformers scales cos/sin by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) only where both are set (nonzero), else by mscale(factor) = 0.1·ln(factor)+1,
    and the softmax by mscale(factor, mscale_all_dim)² where mscale_all_dim is set; Megatron's MLA
    scales the softmax alike and cos/sin by that ratio, or by mscale(factor) where mscale is None.
    beta_fast/beta_slow default to 32/1 when absent or null, original_max_position_embeddings to
    max_position_embeddings (what transformers fills in), as in transformers."""
    rope = _rope(hf)
    if rope.get("factor") is None:
        raise UnsupportedModelError(f"{hf['model_type']} rope_type 'yarn' needs rope_parameters.factor")
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
    original = rope.get("original_max_position_embeddings") or _get(hf, "max_position_embeddings")
    return {
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "mscale": float(rope["mscale"]) if both else None,
        "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


_ROUTER_AUX = {  # transformers returns its aux loss only with output_router_logits; megarl's aux
    # loss coefficient is router_aux_loss_coef unless model.moe_aux_loss_coeff overrides it
    "router_aux_loss_coef": MAPPED, "output_router_logits": INERT,
}

# DeepSeek-V3's sigmoid routing as GLM-4.5 shares it, and its multi-token-prediction layers
_SIGMOID_ROUTING_FIELDS: Dict[str, Union[str, Only]] = {
    "norm_topk_prob": Only(_sigmoid_normalisation_ok,
                           "Megatron renormalises the sigmoid top-k scores exactly when "
                           "num_experts_per_tok > 1: set norm_topk_prob to match"),
    "n_group": Only(_group_scores_ok,
                    "Megatron ranks expert groups by their top num_experts_per_tok//topk_group "
                    "scores, transformers by their top 2: they agree when that is 2 or "
                    "topk_group >= n_group"),
    # Multi-token-prediction layers: transformers does not run them, megarl skips their tensors.
    "num_nextn_predict_layers": INERT, "num_mtp_layers": INERT,
}
# Qwen3-Next's and Qwen3.5's gated delta nets, gated attention and shared-expert MoE
_HYBRID_QWEN_FIELDS: Dict[str, Union[str, Only]] = {
    **BASE_FIELDS, **_ROUTER_AUX,
    **{k: MAPPED for k in (
        "partial_rotary_factor", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size")},
    "layer_types": Only(lambda hf: set(hf.get("layer_types") or ()) <= {"linear_attention", "full_attention"},
                        "each 'linear_attention' or 'full_attention'"),
    "shared_expert_intermediate_size": Only(
        _shared_expert_ok, "only > 0: megarl builds the shared expert and its gate of every MoE layer"),
}
FIELDS: Dict[str, Dict[str, Union[str, Only]]] = {
    "llama": {
        **BASE_FIELDS,
        "mlp_bias": Only(_at("mlp_bias", False), "only false"),
        "pretraining_tp": INERT,  # split matmuls in older transformers, same result; unused in 5.x
    },
    "mistral": {
        **BASE_FIELDS,
        "sliding_window": MAPPED,  # Megatron's window_size (_mistral_window)
    },
    "qwen2": {
        **BASE_FIELDS, **_QWEN_DENSE,
        "attention_bias": INERT,  # transformers' Qwen2 always biases q/k/v and never o_proj
    },
    "qwen3": {**BASE_FIELDS, **_QWEN_DENSE},
    "mixtral": {
        **BASE_FIELDS, **_ROUTER_AUX,
        "sliding_window": Only(_at("sliding_window"), "megarl maps a sliding window for mistral only "
                                                 "(Mixtral's is not checked against transformers); set it to null"),
        "num_local_experts": MAPPED, "num_experts": MAPPED,
        "num_experts_per_tok": Only(lambda hf: hf["num_experts_per_tok"] > 1,
                                    "Megatron cannot route softmax top-1 with weight 1 (Mixtral "
                                    "renormalises); use 2 or more"),
        # transformers jitters the whole MoE input in training; Megatron's moe_input_jitter_eps
        # only the router's input
        "router_jitter_noise": Only(_at("router_jitter_noise", 0), "only 0"),
    },
    "qwen3_moe": {
        **BASE_FIELDS, **_ROUTER_AUX,
        "sliding_window": Only(lambda hf: not hf.get("use_sliding_window") or hf.get("sliding_window") is None,
                               _NO_WINDOW),
        "use_sliding_window": MAPPED,
        "max_window_layers": INERT,  # transformers' Qwen3-MoE slides every layer or none
        **{k: MAPPED for k in ("num_local_experts", "num_experts", "num_experts_per_tok",
                               "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers")},
        "norm_topk_prob": _TOP1_NORM,
    },
    "qwen2_moe": {
        **BASE_FIELDS, **_ROUTER_AUX,
        "attention_bias": INERT,  # transformers' Qwen2-MoE biases q/k/v by qkv_bias, never o_proj
        "sliding_window": Only(_qwen2_moe_no_window, _NO_WINDOW),
        "use_sliding_window": MAPPED, "max_window_layers": MAPPED, "layer_types": MAPPED,
        **{k: MAPPED for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                               "decoder_sparse_step", "mlp_only_layers", "qkv_bias")},
        "shared_expert_intermediate_size": Only(
            _shared_expert_ok, "only > 0: megarl builds the shared expert and its gate of every MoE layer"),
        "norm_topk_prob": _TOP1_NORM,
    },
    "deepseek_v3": {
        **BASE_FIELDS, **_ROUTER_AUX,
        "head_dim": INERT,  # transformers sets it to qk_rope_head_dim
        "qk_head_dim": INERT,  # transformers sets it to qk_nope_head_dim + qk_rope_head_dim
        "num_key_value_heads": Only(lambda hf: hf.get("num_key_value_heads") in (None, hf["num_attention_heads"]),
                                    "MLA has one key/value head per query head: num_attention_heads"),
        "pretraining_tp": INERT,
        **{k: MAPPED for k in (
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "topk_group")},
        "rope_interleave": Only(_at("rope_interleave", True),
                                "only true: Megatron's MLA rope always de-interleaves q_pe/k_pe"),
        # checked wherever the rope is given: rope_parameters, or an older file's rope_scaling
        "rope_parameters": Only(_mla_rope_ok,
                                "rope_type 'default', or 'yarn' without attention_factor and with "
                                "truncate true or absent (Megatron's MLA YaRN derives its attention "
                                "factor from mscale/mscale_all_dim and rounds the correction range)"),
        **_SIGMOID_ROUTING_FIELDS,
        # DeepSeek's own config.json keys that transformers' DeepseekV3 does not read.
        "scoring_func": Only(_at("scoring_func", "sigmoid"), "transformers' DeepseekV3 routes on sigmoid scores"),
        "topk_method": Only(_at("topk_method", "noaux_tc"),
                            "transformers' DeepseekV3 routes with e_score_correction_bias (noaux_tc)"),
        "moe_layer_freq": Only(_at("moe_layer_freq", 1),
                               "transformers' DeepseekV3 makes every layer from first_k_dense_replace on MoE"),
        "ep_size": INERT, "aux_loss_alpha": INERT, "seq_aux": INERT,
    },
    "glm4_moe": {
        **BASE_FIELDS,
        "output_router_logits": INERT,  # Glm4Moe computes no aux loss (moe_aux_loss_coeff 0)
        "attention_bias": MAPPED,  # transformers' Glm4Moe biases q/k/v by it, never o_proj
        **{k: MAPPED for k in (
            "use_qk_norm", "partial_rotary_factor", "n_routed_experts", "num_local_experts",
            "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
            "routed_scaling_factor", "topk_group")},
        "n_shared_experts": Only(lambda hf: _get(hf, "n_shared_experts", default=1) > 0,
                                 "only > 0: transformers' Glm4Moe builds a shared expert of "
                                 "n_shared_experts * moe_intermediate_size in every MoE layer"),
        **_SIGMOID_ROUTING_FIELDS,
    },
    "qwen3_next": {
        **_HYBRID_QWEN_FIELDS,
        **{k: MAPPED for k in ("full_attention_interval", "decoder_sparse_step", "mlp_only_layers")},
        "norm_topk_prob": _TOP1_NORM,
    },
    "qwen3_5_moe_text": {
        **_HYBRID_QWEN_FIELDS,
        # Megatron cannot route softmax top-1 with weight 1 (Qwen3.5 always renormalises the top-k)
        "num_experts_per_tok": Only(lambda hf: hf["num_experts_per_tok"] > 1,
                                    "Megatron cannot route softmax top-1 with weight 1 (Qwen3.5 renormalises "
                                    "the top-k); use 2 or more"),
    },
    # the vision-language wrapper: its text_config is checked as qwen3_5_moe_text's
    "qwen3_5_moe": {
        **{k: v for k, v in BASE_FIELDS.items() if v == INERT},
        "text_config": MAPPED, "tie_word_embeddings": MAPPED, "model_type": MAPPED,
        # the vision tower megarl carries unchanged, and the ids of its placeholder tokens
        **{k: INERT for k in ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                              "vision_end_token_id")},
    },
    "gpt_oss": {
        **BASE_FIELDS, **_ROUTER_AUX,
        # transformers' GptOss does not read hidden_act: its experts always run the clamped SwiGLU
        "hidden_act": INERT,
        "attention_bias": Only(_at("attention_bias", True),
                               "only true: transformers' GptOss attention biases q/k/v/o (megarl maps them)"),
        **{k: MAPPED for k in ("num_local_experts", "num_experts", "sliding_window", "layer_types",
                               "swiglu_limit")},
        "num_experts_per_tok": Only(lambda hf: hf["num_experts_per_tok"] > 1,
                                    "Megatron cannot route softmax top-1 with weight 1 (GptOss softmaxes "
                                    "the top-k logits); use 2 or more"),
        # transformers' GptOss defaults to YaRN (gpt-oss-20b/120b's): Megatron's GPT YaRN embedding
        # (args.yarn, see yarn_settings); what it cannot compute is refused
        "rope_parameters": Only(_gpt_oss_rope_ok,
                                "rope_type 'default', or 'yarn' with a factor, no attention_factor "
                                "and partial_rotary_factor 1 (what Megatron's YaRN embedding computes)"),
        # keys of OpenAI's own gpt-oss config.json that transformers' GptOss does not read
        "experts_per_token": INERT, "initial_context_length": INERT,
        # Megatron's quick_gelu hard-codes x * sigmoid(1.702 x)
        "swiglu_alpha": Only(_at("swiglu_alpha", 1.702),
                             "only 1.702: Megatron's quick_gelu fixes x * sigmoid(1.702 x)"),
    },
}


def check_fields(hf: Mapping[str, Any]) -> None:
    """Refuse, by name, a field set to a value megarl cannot reproduce; warn about fields no table
    knows (their effect on the network is unknown to megarl)."""
    model_type = hf["model_type"]
    table = FIELDS[model_type]
    for name, kind in table.items():
        if isinstance(kind, Only) and not kind.ok(hf):
            raise UnsupportedModelError(
                f"{model_type} config field {name}={hf.get(name)!r} is not supported: {kind.supported}")
    unknown = sorted(set(hf) - set(table))
    if unknown:
        warnings.warn(f"{model_type} config fields megarl does not know, ignored: {unknown}", stacklevel=3)


@dataclass
class MegatronModelArgs:
    """Everything needed to build a GPTModel except the layout."""

    model_type: str
    config_kwargs: Dict[str, Any]
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    mla: bool
    rope_scaling: Optional[Dict[str, Any]] = None
    rotary_percent: float = 1.0  # the fraction of each head's channels the rope rotates
    hf_config: Dict[str, Any] = field(default_factory=dict)
    yarn: Optional[Dict[str, Any]] = None  # Megatron's yarn_* settings of a GPT (non-MLA) YaRN rope
    hf_prefix: str = "model."  # where the HF text model's tensors live (Wrapper.prefix)
    carried: Tuple[str, ...] = ()  # HF tensors under these prefixes are carried, not trained (Wrapper)

    @property
    def num_experts(self) -> Optional[int]:
        return self.config_kwargs.get("num_moe_experts")


def read_hf_config(path_or_dict: Union[str, Path, Mapping[str, Any]]) -> Dict[str, Any]:
    """Load a ``config.json`` (file or directory) or copy a dict."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF config {path} does not exist; model.hf_config must point to a config.json")
    return json.loads(path.read_text())


def megatron_args_from_hf(path_or_dict) -> MegatronModelArgs:
    """Map an HF config onto Megatron arguments; raises :class:`UnsupportedModelError`."""
    hf = read_hf_config(path_or_dict)
    model_type = hf.get("model_type")
    if model_type in WRAPPERS:
        wrapper = WRAPPERS[model_type]
        check_fields(hf)
        if not isinstance(hf.get("text_config"), Mapping):
            raise UnsupportedModelError(f"{model_type} config lacks its text_config")
        text = {**hf["text_config"], "model_type": wrapper.text_model_type,
                "tie_word_embeddings": bool(_get(hf, "tie_word_embeddings", default=False))}
        inner = megatron_args_from_hf(text)
        return dataclasses.replace(inner, hf_config=hf, hf_prefix=wrapper.prefix, carried=wrapper.carried)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not supported; supported: {sorted([*ARCHITECTURES, *WRAPPERS])}")
    arch = ARCHITECTURES[model_type]
    kwargs: Dict[str, Any] = {}
    for name, row in arch.rows.items():
        try:
            value = hf[row] if isinstance(row, str) else row(hf)
        except KeyError as missing:
            raise UnsupportedModelError(
                f"{model_type} config lacks {missing} (needed for Megatron field '{name}')") from None
        if value is not None or name in KEEP_NULL:
            kwargs[name] = value
    check_fields(hf)
    if not kwargs.get("num_moe_experts"):  # absent or 0: a dense model
        for name in [k for k in kwargs if k in MOE or k.startswith("moe_")]:
            kwargs.pop(name)
    rope = _rope(hf)
    rope_type = rope["rope_type"]
    rope_scaling = None
    rotary_percent = 1.0 if arch.rotary_percent is None else arch.rotary_percent(hf)
    if not 0.0 < rotary_percent <= 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={rotary_percent} is not supported: only 0 < it <= 1")
    if rotary_percent < 1.0 and rope_type != "default":
        # Megatron scales the partial rope's frequencies only as llama3; unchecked against transformers
        raise UnsupportedModelError(
            f"rope_type '{rope_type}' with partial_rotary_factor={rotary_percent} ({model_type}) is not "
            f"supported; only 'default' rope with a partial rotary factor")
    yarn = None
    if arch.mla:
        kwargs["rope_type"] = "rope" if rope_type == "default" else rope_type
        if rope_type == "yarn":  # its FIELDS row refused what Megatron's MLA YaRN cannot compute
            kwargs.update(mla_yarn_settings(hf))
        elif rope_type != "default":
            raise UnsupportedModelError(f"rope_type '{rope_type}' is not supported for MLA; use 'default' or 'yarn'")
    elif rope_type == "llama3":
        # Megatron's llama3 scaling takes only the factor; the other three are fixed.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in fixed.items():
            if float(rope.get(key, value)) != float(value):
                raise UnsupportedModelError(
                    f"rope_parameters.{key}={rope[key]} is not supported: Megatron's llama3 rope "
                    f"scaling fixes it to {value}")
        rope_scaling = rope
    elif rope_type == "yarn" and model_type == "gpt_oss":  # its FIELDS row checked the parameters
        yarn = yarn_settings(hf)
    elif rope_type != "default":
        raise UnsupportedModelError(
            f"rope_type '{rope_type}' ({model_type}) is not supported; supported: 'default', 'llama3'")
    return MegatronModelArgs(
        model_type=model_type,
        config_kwargs=kwargs,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=_get(hf, "max_position_embeddings", default=4096),
        tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", default=False)),
        mla=arch.mla,
        rope_scaling=rope_scaling,
        rotary_percent=rotary_percent,
        hf_config=hf,
        yarn=yarn,
    )


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round the vocabulary up to ``multiple`` (layout-independent, so checkpoints move between tp)."""
    return -(-vocab_size // multiple) * multiple
