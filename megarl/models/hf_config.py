"""Hugging Face ``config.json`` → Megatron ``TransformerConfig`` and ``GPTModel`` arguments.

One declarative table per architecture (``ARCHITECTURES``): each row maps a Megatron field to
an HF key or to a small function of the HF config. Common rows are shared; an architecture
lists only what differs. Unsupported ``model_type`` values and rope types fail with the list of
what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

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
    if "first_k_dense_replace" in hf:  # DeepSeek-V3: the first k layers are dense
        k = hf["first_k_dense_replace"]
        step = _get(hf, "moe_layer_freq", default=1)
        return [1 if (i >= k and (i - k) % step == 0) else 0 for i in range(n)]
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
    # softmax over all experts then top-k and renormalise == top-k then softmax (pre_softmax False)
    "moe_router_pre_softmax": lambda hf: not _get(hf, "norm_topk_prob", default=True),
    "moe_aux_loss_coeff": lambda hf: float(_get(hf, "router_aux_loss_coef", default=0.0)),
}

DEEPSEEK_V3: Dict[str, Row] = {
    **MOE,
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_shared_expert_intermediate_size": lambda hf: hf["n_shared_experts"] * hf["moe_intermediate_size"],
    "moe_router_score_function": lambda hf: _get(hf, "scoring_func", default="sigmoid"),
    "moe_router_enable_expert_bias": lambda hf: _get(hf, "topk_method", default="noaux_tc") == "noaux_tc",
    "moe_router_topk_scaling_factor": lambda hf: _get(hf, "routed_scaling_factor", default=1.0),
    "moe_router_num_groups": lambda hf: _get(hf, "n_group"),
    "moe_router_group_topk": lambda hf: _get(hf, "topk_group"),
    "moe_router_pre_softmax": lambda hf: True,
    "moe_router_dtype": lambda hf: "fp32",
    "moe_router_bias_update_rate": lambda hf: 1e-3,
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "qk_layernorm": lambda hf: True,  # q_a_layernorm / kv_a_layernorm
    "num_query_groups": "num_attention_heads",
    "kv_channels": "v_head_dim",
}


@dataclass(frozen=True)
class Architecture:
    """How one HF ``model_type`` maps onto Megatron."""

    rows: Dict[str, Row]
    mla: bool = False


ARCHITECTURES: Dict[str, Architecture] = {
    "llama": Architecture(COMMON),
    "qwen2": Architecture({**COMMON, "add_qkv_bias": lambda hf: True}),
    "qwen3": Architecture({**COMMON, "qk_layernorm": lambda hf: True}),
    "mixtral": Architecture({**COMMON, **MOE}),
    "qwen3_moe": Architecture({**COMMON, **MOE, "qk_layernorm": lambda hf: True}),
    "deepseek_v3": Architecture({**COMMON, **DEEPSEEK_V3}, mla=True),
}


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
    hf_config: Dict[str, Any] = field(default_factory=dict)

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
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not supported; supported: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    act = _get(hf, "hidden_act", default="silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act '{act}' is not supported (only 'silu' with a gated MLP)")
    # Megatron has one switch for every linear bias besides QKV; HF's attention_bias also puts
    # a bias on o_proj (all but qwen2, whose q/k/v-only bias is built in), mlp_bias on the MLP.
    if model_type != "qwen2" and _get(hf, "attention_bias", default=False):
        raise UnsupportedModelError(f"{model_type} with attention_bias=true (a bias on o_proj) is not supported")
    if _get(hf, "mlp_bias", default=False):
        raise UnsupportedModelError(f"{model_type} with mlp_bias=true is not supported")
    kwargs: Dict[str, Any] = {}
    for name, row in arch.rows.items():
        try:
            value = hf[row] if isinstance(row, str) else row(hf)
        except KeyError as missing:
            raise UnsupportedModelError(
                f"{model_type} config lacks {missing} (needed for Megatron field '{name}')") from None
        if value is not None:
            kwargs[name] = value
    if not kwargs.get("num_moe_experts"):  # absent or 0: a dense model
        for name in MOE:
            kwargs.pop(name, None)
    rope = _rope(hf)
    rope_type = rope["rope_type"]
    rope_scaling = None
    if arch.mla:
        if not _get(hf, "rope_interleave", default=True):
            # Megatron's MLA rope always de-interleaves q_pe/k_pe, as rope_interleave=true does.
            raise UnsupportedModelError("deepseek_v3 with rope_interleave=false is not supported")
        kwargs["rope_type"] = "rope" if rope_type == "default" else rope_type
        if rope_type == "yarn":
            kwargs.update(
                rotary_scaling_factor=rope["factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
                beta_fast=rope.get("beta_fast", 32), beta_slow=rope.get("beta_slow", 1),
                mscale=rope.get("mscale", 1.0), mscale_all_dim=rope.get("mscale_all_dim", 0.0))
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
        hf_config=hf,
    )


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round the vocabulary up to ``multiple`` (layout-independent, so checkpoints move between tp)."""
    return -(-vocab_size // multiple) * multiple
