"""HF ↔ Megatron weight mapping: one declarative table per architecture plus shared transforms.

A :class:`Rule` ties one Megatron tensor (its dist-checkpoint key, the *global* tensor every
layout shards) to the HF tensors it is made of, through a :class:`Transform` that has both
directions (``to_mcore`` and ``to_hf``), so the HF → Megatron and Megatron → HF converters are
derived from the same table. ``{L}`` stands for the layer index, ``{E}`` for the expert index of
rules whose Megatron tensor stacks all experts of a layer ([num_experts, ...]).

Keys are those of megatron-core's local layer spec (what megarl builds without Transformer
Engine); where the Transformer Engine spec names a tensor differently (norms fused into the
next linear, or not), the rule carries that name too (``te``), so a TE-built model or a
checkpoint written by one maps through the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megarl.models.hf_config import MegatronModelArgs, UnsupportedModelError, padded_vocab_size


class ConversionError(ValueError):
    """Checkpoint contents that do not match the model; the message names the tensor."""


# ----------------------------------------------------------------------------- transforms


class Transform:
    """Global Megatron tensor ↔ HF tensors (in the order of the rule's ``hf`` names)."""

    def to_mcore(self, hf: Sequence[torch.Tensor]) -> torch.Tensor:
        (tensor,) = hf
        return tensor

    def to_hf(self, mcore: torch.Tensor) -> List[torch.Tensor]:
        return [mcore]


IDENTITY = Transform()


@dataclass(frozen=True)
class GateUp(Transform):
    """SwiGLU fc1: Megatron's global ``linear_fc1`` is ``[gate; up]`` stacked on rows."""

    def to_mcore(self, hf):
        gate, up = hf
        return torch.cat([gate, up], dim=0)

    def to_hf(self, mcore):
        return list(torch.chunk(mcore, 2, dim=0))


@dataclass(frozen=True)
class QKV(Transform):
    """Fused QKV, grouped by query group: per group ``[q heads of the group; k; v]`` rows
    (Megatron's layout, which tensor parallelism splits by whole groups). Works for biases too."""

    num_heads: int
    num_groups: int
    head_dim: int

    def to_mcore(self, hf):
        q, k, v = hf
        g, rest = self.num_groups, q.shape[1:]
        per = self.num_heads // g * self.head_dim
        return torch.cat([q.reshape(g, per, *rest), k.reshape(g, self.head_dim, *rest),
                          v.reshape(g, self.head_dim, *rest)], dim=1).reshape(-1, *rest)

    def to_hf(self, mcore):
        g, rest = self.num_groups, mcore.shape[1:]
        per = self.num_heads // g * self.head_dim
        grouped = mcore.reshape(g, per + 2 * self.head_dim, *rest)
        q, k, v = torch.split(grouped, [per, self.head_dim, self.head_dim], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


@dataclass(frozen=True)
class StackedExperts(Transform):
    """All experts of a layer in one HF tensor (GptOss), leading axis the expert on both sides.

    ``transpose``: HF keeps an expert's matrix as ``x @ W`` ([in, out], nn.Linear's transpose);
    ``interleaved``: HF's fused gate/up alternates gate and up columns (``[..., ::2]`` is the
    gate), Megatron's ``linear_fc1`` stacks ``[gate; up]``. Works on any leading slice of
    experts, and for biases (``transpose=False``)."""

    transpose: bool = False
    interleaved: bool = False

    def to_mcore(self, hf):
        (tensor,) = hf
        if self.interleaved:
            tensor = torch.cat([tensor[..., ::2], tensor[..., 1::2]], dim=-1)
        return tensor.transpose(-1, -2).contiguous() if self.transpose else tensor

    def to_hf(self, mcore):
        tensor = mcore.transpose(-1, -2) if self.transpose else mcore
        if self.interleaved:
            gate, up = torch.chunk(tensor, 2, dim=-1)
            tensor = torch.stack([gate, up], dim=-1).flatten(-2)
        return [tensor.contiguous()]


@dataclass(frozen=True)
class VocabPad(Transform):
    """Embedding / output rows padded with zeros from ``vocab`` to ``padded`` (TP-friendly)."""

    vocab: int
    padded: int

    def to_mcore(self, hf):
        (tensor,) = hf
        if tensor.shape[0] != self.vocab:
            raise ConversionError(f"has {tensor.shape[0]} rows, the config's vocab_size is {self.vocab}")
        return torch.nn.functional.pad(tensor, (0, 0, 0, self.padded - self.vocab))

    def to_hf(self, mcore):
        return [mcore[: self.vocab]]


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensors it is made of."""

    mcore: str
    hf: Tuple[str, ...]
    transform: Transform = IDENTITY
    experts: bool = False  # the Megatron tensor stacks the experts of a layer on a leading axis
    te: Optional[str] = None  # the key under the Transformer Engine layer spec, where it differs
    # the HF tensor stacks the experts too (one item per layer, not per expert; GptOss)
    stacked: bool = False

    def names(self) -> Tuple[str, ...]:
        """Every key this tensor goes by (local spec first)."""
        return (self.mcore,) if self.te is None else (self.mcore, self.te)

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> List[str]:
        return [n.format(L=layer, E=expert) for n in self.hf]


def R(mcore: str, hf, transform: Transform = IDENTITY, experts: bool = False, te: Optional[str] = None,
      stacked: bool = False) -> Rule:
    return Rule(mcore, hf if isinstance(hf, tuple) else (hf,), transform, experts, te, stacked)


def _qkv(args: MegatronModelArgs) -> QKV:
    kw = args.config_kwargs
    return QKV(kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"])


def _gqa_attention(args: MegatronModelArgs) -> List[Rule]:
    attn = "model.layers.{L}.self_attn."
    rules = [
        R("self_attention.linear_qkv.layer_norm_weight", "model.layers.{L}.input_layernorm.weight"),
        R("self_attention.linear_qkv.weight", tuple(attn + p + "_proj.weight" for p in "qkv"), _qkv(args)),
        R("self_attention.linear_proj.weight", attn + "o_proj.weight"),
    ]
    kw = args.config_kwargs
    if kw.get("add_qkv_bias") or kw.get("add_bias_linear"):
        rules.append(R("self_attention.linear_qkv.bias", tuple(attn + p + "_proj.bias" for p in "qkv"), _qkv(args)))
    if kw.get("add_bias_linear"):
        rules.append(R("self_attention.linear_proj.bias", attn + "o_proj.bias"))
    if kw.get("softmax_type") == "learnable":  # GptOss's attention sinks, one logit per head
        rules.append(R("self_attention.core_attention.softmax_offset", attn + "sinks"))
    if args.config_kwargs.get("qk_layernorm"):
        rules += [R("self_attention.q_layernorm.weight", attn + "q_norm.weight"),
                  R("self_attention.k_layernorm.weight", attn + "k_norm.weight")]
    return rules


def _mla_attention(args: MegatronModelArgs) -> List[Rule]:
    # No re-ordering of the rope rows: Megatron's MLA rope de-interleaves q_pe/k_pe exactly as
    # HF DeepSeek-V3 does with rope_interleave (checked against transformers' logits).
    kw, attn = args.config_kwargs, "model.layers.{L}.self_attn."
    rules = [
        R("input_layernorm.weight", "model.layers.{L}.input_layernorm.weight"),
        R("self_attention.linear_kv_down_proj.weight", attn + "kv_a_proj_with_mqa.weight"),
        # TE fuses the latent norms into the up-projections (TELayerNormColumnParallelLinear).
        R("self_attention.kv_layernorm.weight", attn + "kv_a_layernorm.weight",
          te="self_attention.linear_kv_up_proj.layer_norm_weight"),
        R("self_attention.linear_kv_up_proj.weight", attn + "kv_b_proj.weight"),
        R("self_attention.linear_proj.weight", attn + "o_proj.weight"),
    ]
    if kw.get("q_lora_rank"):
        rules += [R("self_attention.linear_q_down_proj.weight", attn + "q_a_proj.weight"),
                  R("self_attention.q_layernorm.weight", attn + "q_a_layernorm.weight",
                    te="self_attention.linear_q_up_proj.layer_norm_weight"),
                  R("self_attention.linear_q_up_proj.weight", attn + "q_b_proj.weight")]
    else:
        rules.append(R("self_attention.linear_q_proj.weight", attn + "q_proj.weight"))
    return rules


def _dense_mlp(norm_key: str, norm_te: Optional[str], hf_mlp: str = "model.layers.{L}.mlp.") -> List[Rule]:
    return [
        R(norm_key, "model.layers.{L}.post_attention_layernorm.weight", te=norm_te),
        R("mlp.linear_fc1.weight", (hf_mlp + "gate_proj.weight", hf_mlp + "up_proj.weight"), GateUp()),
        R("mlp.linear_fc2.weight", hf_mlp + "down_proj.weight"),
    ]


@dataclass(frozen=True)
class MoENames:
    """HF names of a family's MoE block, after ``model.layers.{L}.``: the block, its routed
    experts' gate/up/down projections, its shared experts and the shared experts' gate, if any."""

    block: str = "mlp."
    experts: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = "shared_experts."
    shared_gate: str = "shared_expert_gate.weight"
    router: str = "gate"
    # all experts in one tensor per projection (GptOss: experts.gate_up_proj [E, H, 2I] with
    # gate/up interleaved, experts.down_proj [E, I, H], and their biases)
    stacked: bool = False


MOE_NAMES: Dict[str, MoENames] = {
    "mixtral": MoENames(block="block_sparse_moe.", experts=("w1", "w3", "w2")),
    "qwen2_moe": MoENames(shared="shared_expert."),  # one shared expert, singular
    "gpt_oss": MoENames(router="router", stacked=True),
}


def _stacked_experts(block: str) -> List[Rule]:
    experts, fc1, fc2 = block + "experts.", "mlp.experts.experts.linear_fc1.", "mlp.experts.experts.linear_fc2."
    return [
        R(fc1 + "weight", experts + "gate_up_proj", StackedExperts(transpose=True, interleaved=True), stacked=True),
        R(fc1 + "bias", experts + "gate_up_proj_bias", StackedExperts(interleaved=True), stacked=True),
        R(fc2 + "weight", experts + "down_proj", StackedExperts(transpose=True), stacked=True),
        R(fc2 + "bias", experts + "down_proj_bias", StackedExperts(), stacked=True),
    ]


def _moe(args: MegatronModelArgs) -> List[Rule]:
    """Router, routed experts, expert bias, shared experts and their gate of an MoE layer."""
    kw, names = args.config_kwargs, MOE_NAMES.get(args.model_type, MoENames())
    block = "model.layers.{L}." + names.block
    expert = block + "experts.{E}."
    gate, up, down = (expert + p + ".weight" for p in names.experts)
    rules = [R("mlp.router.weight", block + names.router + ".weight")]
    if kw.get("add_bias_linear"):
        rules.append(R("mlp.router.bias", block + names.router + ".bias"))
    if names.stacked:
        if kw.get("add_bias_linear") is not True:
            raise UnsupportedModelError(f"{args.model_type}: stacked experts are mapped with their biases only")
        rules += _stacked_experts(block)
    else:
        if kw.get("add_bias_linear"):
            raise UnsupportedModelError(f"{args.model_type}: no mapping for per-expert biases")
        rules += [R("mlp.experts.experts.linear_fc1.weight", (gate, up), GateUp(), experts=True),
                  R("mlp.experts.experts.linear_fc2.weight", down, experts=True)]
    if kw.get("moe_router_enable_expert_bias"):
        rules.append(R("mlp.router.expert_bias", block + "gate.e_score_correction_bias"))
    if kw.get("moe_shared_expert_intermediate_size"):
        shared = block + names.shared
        rules += [R("mlp.shared_experts.linear_fc1.weight", (shared + "gate_proj.weight", shared + "up_proj.weight"), GateUp()),
                  R("mlp.shared_experts.linear_fc2.weight", shared + "down_proj.weight")]
    if kw.get("moe_shared_expert_gate"):  # Megatron's [1, hidden] gate weight is HF's Linear(hidden, 1)
        rules.append(R("mlp.shared_experts.gate_weight", block + names.shared_gate))
    return rules


def layer_rules(args: MegatronModelArgs, layer: int) -> List[Rule]:
    """Rules of decoder layer ``layer`` (dense or MoE by the config's layer pattern)."""
    kw = args.config_kwargs
    moe = bool(kw.get("num_moe_experts")) and kw["moe_layer_freq"][layer] == 1
    # The pre-MLP norm: the local GQA spec renames it to TE's fused name
    # (``sharded_state_dict_keys_map``), the local MLA spec does not; TE fuses it into a dense
    # MLP's linear_fc1 and keeps it apart before an MoE layer.
    fused, apart = "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"
    norm_key = apart if args.mla else fused
    rules = _mla_attention(args) if args.mla else _gqa_attention(args)
    if not moe:
        return rules + _dense_mlp(norm_key, fused if args.mla else None)
    rules.append(R(norm_key, "model.layers.{L}.post_attention_layernorm.weight", te=None if args.mla else apart))
    return rules + _moe(args)


def global_rules(args: MegatronModelArgs, vocab_multiple: int) -> List[Rule]:
    """Embedding, final norm and output layer."""
    pad = VocabPad(args.vocab_size, padded_vocab_size(args.vocab_size, vocab_multiple))
    rules = [R("embedding.word_embeddings.weight", "model.embed_tokens.weight", pad),
             R("decoder.final_layernorm.weight", "model.norm.weight")]
    if not args.tie_word_embeddings:
        rules.append(R("output_layer.weight", "lm_head.weight", pad))
    return rules


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Item:
    """One Megatron tensor (an expert slice for stacked experts) and its HF tensors."""

    mcore_key: str
    hf_names: Tuple[str, ...]
    rule: Rule
    layer: Optional[int] = None
    expert: Optional[int] = None


@dataclass
class Plan:
    """Every Megatron tensor of a model and the HF tensors it is made of."""

    items: List[Item] = field(default_factory=list)

    def by_mcore_key(self, te_names: bool = True) -> Dict[str, List[Item]]:
        """Items by Megatron key; with ``te_names`` also under their Transformer Engine keys."""
        out: Dict[str, List[Item]] = {}
        for item in self.items:
            out.setdefault(item.mcore_key, []).append(item)
            if te_names and item.rule.te is not None:
                prefix = item.mcore_key[: len(item.mcore_key) - len(item.rule.mcore)]
                out.setdefault(prefix + item.rule.te, []).append(item)
        return out

    def hf_names(self) -> List[str]:
        return [name for item in self.items for name in item.hf_names]


def build_plan(args: MegatronModelArgs, vocab_multiple: int) -> Plan:
    """The full mapping for one model (pure: no tensors)."""
    if args.model_type not in SUPPORTED:
        raise UnsupportedModelError(f"no conversion table for model_type '{args.model_type}'; "
                                    f"supported: {sorted(SUPPORTED)}")
    plan = Plan()
    for rule in global_rules(args, vocab_multiple):
        plan.items.append(Item(rule.mcore, tuple(rule.hf_names()), rule))
    num_experts = args.config_kwargs.get("num_moe_experts") or 0
    for layer in range(args.config_kwargs["num_layers"]):
        for rule in layer_rules(args, layer):
            key = f"decoder.layers.{layer}.{rule.mcore}"
            experts = range(num_experts) if rule.experts else [None]
            for expert in experts:
                plan.items.append(Item(key, tuple(rule.hf_names(layer, expert)), rule, layer, expert))
    return plan


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe",
             "gpt_oss")

_MTP = re.compile(r"^model\.layers\.(\d+)\.")


def skipped_hf_names(args: MegatronModelArgs, names: Sequence[str]) -> List[str]:
    """HF tensors megarl does not convert: DeepSeek's and GLM-4.5's multi-token-prediction layers
    (indices past num_hidden_layers), which transformers itself does not load either."""
    num_layers = args.config_kwargs["num_layers"]
    return [n for n in names if (m := _MTP.match(n)) and int(m.group(1)) >= num_layers]


def check_names(plan: Plan, available: Sequence[str], skipped: Sequence[str], source: str) -> None:
    """Raise naming the first missing and unexpected tensors of an HF checkpoint."""
    expected = set(plan.hf_names())
    have = set(available) - set(skipped)
    missing = sorted(expected - have)
    unexpected = sorted(have - expected)
    problems = []
    if missing:
        item = next(i for i in plan.items if missing[0] in i.hf_names)
        problems.append(f"{len(missing)} tensor(s) missing from {source}, first: '{missing[0]}' "
                        f"(needed for Megatron '{item.mcore_key}')")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) in {source} that the model config "
                        f"does not explain, first: '{unexpected[0]}'")
    if problems:
        raise ConversionError("; ".join(problems))
