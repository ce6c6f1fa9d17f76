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

import dataclasses
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
class GatedQKV(Transform):
    """Gated attention (Qwen3-Next, Qwen3.5): HF's ``q_proj`` gives each head ``[q; gate]``
    (``head_dim`` rows each); Megatron's ``linear_qkv`` with ``attention_output_gate`` is per query
    group ``[q heads; their gates; k; v]`` (attention.get_query_key_value_tensors)."""

    num_heads: int
    num_groups: int
    head_dim: int

    def to_mcore(self, hf):
        qg, k, v = hf
        g, d, rest = self.num_groups, self.head_dim, qg.shape[1:]
        per = self.num_heads // g
        heads = qg.reshape(g, per, 2, d, *rest)
        q, gate = heads[:, :, 0].reshape(g, per * d, *rest), heads[:, :, 1].reshape(g, per * d, *rest)
        return torch.cat([q, gate, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)

    def to_hf(self, mcore):
        g, d, rest = self.num_groups, self.head_dim, mcore.shape[1:]
        per = self.num_heads // g
        q, gate, k, v = torch.split(mcore.reshape(g, 2 * per * d + 2 * d, *rest), [per * d, per * d, d, d], dim=1)
        qg = torch.stack([q.reshape(g, per, d, *rest), gate.reshape(g, per, d, *rest)], dim=2)
        return [qg.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()]


@dataclass(frozen=True)
class DeltaNetInProj(Transform):
    """The gated delta net's input projection. Megatron's ``in_proj`` is ``[Q; K; V; Z; B; A]``
    (every head of each, a checkpoint key per part: Megatron's GatedDeltaNet.sharded_state_dict).
    Qwen3-Next's HF ``in_proj_qkvz`` groups by key head (per key head ``[q; k; v; z]``, v and z of
    the ``nv/nk`` value heads it serves) and ``in_proj_ba`` likewise ``[b; a]``; Qwen3.5's
    (``grouped=False``) are ``in_proj_qkv`` (``[Q; K; V]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    grouped: bool = True

    def _sizes(self):
        nk, nv, dk, dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        return [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv]

    def to_mcore(self, hf):
        if not self.grouped:
            return torch.cat(list(hf), dim=0)
        qkvz, ba = hf
        nk, r, dk, dv, rest = self.key_heads, self.value_heads // self.key_heads, self.key_dim, self.value_dim, qkvz.shape[1:]
        q, k, v, z = torch.split(qkvz.reshape(nk, 2 * dk + 2 * r * dv, *rest), [dk, dk, r * dv, r * dv], dim=1)
        b, a = torch.split(ba.reshape(nk, 2 * r, *rest), [r, r], dim=1)
        return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)], dim=0)

    def to_hf(self, mcore):
        q, k, v, z, b, a = torch.split(mcore, self._sizes(), dim=0)
        if not self.grouped:
            return [torch.cat([q, k, v], dim=0), z, b, a]
        nk, rest = self.key_heads, mcore.shape[1:]
        group = lambda t: t.reshape(nk, -1, *rest)
        qkvz = torch.cat([group(q), group(k), group(v), group(z)], dim=1).reshape(-1, *rest)
        ba = torch.cat([group(b), group(a)], dim=1).reshape(-1, *rest)
        return [qkvz, ba]


@dataclass(frozen=True)
class ZeroCentred(Transform):
    """A plain (``w``) HF norm weight stored zero-centred (``w - 1``) in Megatron: the gated delta
    net's output norm, which Megatron builds with the config's zero-centred gamma while
    transformers' gated RMSNorm scales by ``w`` itself (Megatron-Bridge stores it the same way).
    Exact both ways for ``w >= 0.5`` (Sterbenz: ``w - 1`` is then representable)."""

    def to_mcore(self, hf):
        (tensor,) = hf
        return tensor - 1

    def to_hf(self, mcore):
        return [mcore + 1]


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
    # row blocks Megatron's checkpoint keeps under keys of their own (``{mcore}.{name}``, the
    # gated delta net's in_proj and conv1d): (name, rows) each, in order
    parts: Tuple[Tuple[str, int], ...] = ()

    def part_rows(self, name: str) -> Tuple[int, int]:
        """Rows [start, stop) of part ``name`` in the whole tensor."""
        start = 0
        for part, rows in self.parts:
            if part == name:
                return start, start + rows
            start += rows
        raise KeyError(name)

    def names(self) -> Tuple[str, ...]:
        """Every key this tensor goes by (local spec first)."""
        return (self.mcore,) if self.te is None else (self.mcore, self.te)

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> List[str]:
        return [n.format(L=layer, E=expert) for n in self.hf]


def R(mcore: str, hf, transform: Transform = IDENTITY, experts: bool = False, te: Optional[str] = None,
      stacked: bool = False, parts: Tuple[Tuple[str, int], ...] = ()) -> Rule:
    return Rule(mcore, hf if isinstance(hf, tuple) else (hf,), transform, experts, te, stacked, parts)


def _qkv(args: MegatronModelArgs) -> QKV:
    kw = args.config_kwargs
    return QKV(kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"])


def _gqa_attention(args: MegatronModelArgs) -> List[Rule]:
    attn = "model.layers.{L}.self_attn."
    kw = args.config_kwargs
    qkv = _qkv(args)
    if kw.get("attention_output_gate"):
        qkv = GatedQKV(qkv.num_heads, qkv.num_groups, qkv.head_dim)
    rules = [
        R("self_attention.linear_qkv.layer_norm_weight", "model.layers.{L}.input_layernorm.weight"),
        R("self_attention.linear_qkv.weight", tuple(attn + p + "_proj.weight" for p in "qkv"), qkv),
        R("self_attention.linear_proj.weight", attn + "o_proj.weight"),
    ]
    kw = args.config_kwargs
    if kw.get("add_qkv_bias") or kw.get("add_bias_linear"):
        rules.append(R("self_attention.linear_qkv.bias", tuple(attn + p + "_proj.bias" for p in "qkv"), qkv))
    if kw.get("add_bias_linear"):
        rules.append(R("self_attention.linear_proj.bias", attn + "o_proj.bias"))
    if kw.get("softmax_type") == "learnable":  # GptOss's attention sinks, one logit per head
        rules.append(R("self_attention.core_attention.softmax_offset", attn + "sinks"))
    if args.config_kwargs.get("qk_layernorm"):
        rules += [R("self_attention.q_layernorm.weight", attn + "q_norm.weight"),
                  R("self_attention.k_layernorm.weight", attn + "k_norm.weight")]
    return rules


def _delta_net(args: MegatronModelArgs) -> List[Rule]:
    """A gated-delta-net layer's token mixer (Megatron's GatedDeltaNet keys; the input norm under
    Transformer Engine's fused name, as the local spec saves it)."""
    kw, attn = args.config_kwargs, "model.layers.{L}.linear_attn."
    nk, nv = kw["linear_num_key_heads"], kw["linear_num_value_heads"]
    dk, dv = kw["linear_key_head_dim"], kw["linear_value_head_dim"]
    grouped = args.model_type == "qwen3_next"  # Qwen3.5 keeps in_proj_qkv, _z, _b, _a apart
    in_proj = DeltaNetInProj(nk, nv, dk, dv, grouped)
    hf_in = (attn + "in_proj_qkvz.weight", attn + "in_proj_ba.weight") if grouped else \
        tuple(attn + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
    qkv_parts = (("query", nk * dk), ("key", nk * dk), ("value", nv * dv))
    mixer = "self_attention."
    return [
        R(mixer + "in_proj.layer_norm_weight", "model.layers.{L}.input_layernorm.weight"),
        R(mixer + "in_proj.weight", hf_in, in_proj,
          parts=qkv_parts + (("z", nv * dv), ("beta", nv), ("alpha", nv))),
        R(mixer + "conv1d.weight", attn + "conv1d.weight", parts=qkv_parts),
        R(mixer + "A_log", attn + "A_log"),
        R(mixer + "dt_bias", attn + "dt_bias"),
        R(mixer + "out_norm.weight", attn + "norm.weight", ZeroCentred()),
        R(mixer + "out_proj.weight", attn + "out_proj.weight"),
    ]


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
    "qwen3_next": MoENames(shared="shared_expert."),
    "qwen3_5_moe_text": MoENames(shared="shared_expert."),
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
    if kw.get("experimental_attention_variant") == "gated_delta_net" and kw["linear_attention_freq"][layer]:
        rules = _delta_net(args)
    else:
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
    part: Optional[str] = None  # one of the rule's parts (its own checkpoint key)


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
        # a rule stored in parts reads its HF tensors once (listed with its first part)
        return [name for item in self.items if item.part in (None, next(iter(item.rule.parts), ("",))[0])
                for name in item.hf_names]


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
                for part in [name for name, _ in rule.parts] or [None]:
                    plan.items.append(Item(key if part is None else f"{key}.{part}",
                                           tuple(rule.hf_names(layer, expert)), rule, layer, expert, part))
    if args.hf_prefix != "model.":  # a wrapped text model (hf_config.Wrapper): its tensors' prefix
        def moved(name: str) -> str:
            return args.hf_prefix + name[len("model."):] if name.startswith("model.") else name

        plan.items = [dataclasses.replace(item, hf_names=tuple(moved(n) for n in item.hf_names)) for item in plan.items]
    return plan


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe",
             "gpt_oss", "qwen3_next", "qwen3_5_moe_text")



def skipped_hf_names(args: MegatronModelArgs, names: Sequence[str]) -> List[str]:
    """HF tensors megarl does not convert: the multi-token-prediction layers of DeepSeek and GLM-4.5
    (indices past num_hidden_layers) and of Qwen3-Next and Qwen3.5 (``mtp.*``), which transformers
    itself does not load either; and what a wrapped model carries unchanged (Qwen3.5's vision
    tower, hf_config.Wrapper)."""
    num_layers = args.config_kwargs["num_layers"]
    mtp = re.compile("^" + re.escape(args.hf_prefix) + r"layers\.(\d+)\.")
    return [n for n in names if ((m := mtp.match(n)) and int(m.group(1)) >= num_layers) or n.startswith("mtp.")
            or n.startswith(args.carried)]


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
