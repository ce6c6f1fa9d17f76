"""Which slice of which global tensor each rank holds in a layout: the pure sharding model under
the 3D-HybridEngine planner (no tensors, no process groups).

Every weight is a :class:`TensorSpec` named by its key in a single-process model (tp=pp=ep=1),
e.g. ``decoder.layers.7.mlp.experts.local_experts.12.linear_fc1.weight``. A rank's local tensor
is a list of :class:`Piece` s: ranges of the global tensor along its split dim and where they
sit in the local one. Megatron's fused SwiGLU ``linear_fc1`` is two blocks ([gate; up]) that
tensor parallelism splits separately, so a shard is [gate_i; up_i]: two pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Dict, List, Optional, Tuple, Union

from megarl.models.hf_config import MegatronModelArgs, padded_vocab_size
from megarl.parallel.layout import Layout


@dataclass(frozen=True)
class TensorSpec:
    """One global weight and how Megatron splits it."""

    key: str
    shape: Tuple[int, ...]
    dim: Optional[int]  # tensor-parallel dim; None = replicated over tp
    # fused blocks along ``dim``, each split on its own: a number of equal ones (gate/up: 2) or
    # their sizes (the gated delta net's in_proj [Q; K; V; Z; B; A] and conv1d [Q; K; V])
    blocks: Union[int, Tuple[int, ...]] = 1
    stage: str = "layer"  # "first" (embedding), "last" (final norm, output layer) or "layer"
    layer: Optional[int] = None
    expert: Optional[int] = None  # global expert index: split by etp, placed by ep
    buffer: bool = False  # a persistent buffer (router expert bias), not a parameter

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def split_dim(self) -> int:
        return 0 if self.dim is None else self.dim

    def block_bounds(self) -> List[Tuple[int, int]]:
        """(start, size) of each fused block along the split dim."""
        if isinstance(self.blocks, int):
            size = self.shape[self.split_dim] // self.blocks
            return [(b * size, size) for b in range(self.blocks)]
        starts = [sum(self.blocks[:b]) for b in range(len(self.blocks))]
        return list(zip(starts, self.blocks))

    def slice_numel(self, length: int) -> int:
        """Elements in a range of ``length`` along the split dim."""
        return self.numel // self.shape[self.split_dim] * length


@dataclass(frozen=True)
class Piece:
    """Global range [start, stop) along the split dim, at ``local_start`` in the local tensor."""

    start: int
    stop: int
    local_start: int


@dataclass(frozen=True)
class LocalTensor:
    """A tensor as one rank holds it: model chunk, local name, spec and pieces."""

    chunk: int
    name: str
    spec: int  # index into the model's spec list
    shape: Tuple[int, ...]
    pieces: Tuple[Piece, ...]


@dataclass(frozen=True)
class ModelSpec:
    """Every weight of a model, in model order, plus what placement needs."""

    tensors: Tuple[TensorSpec, ...]
    num_layers: int
    num_experts: int
    tied_embeddings: bool

    @classmethod
    def from_args(cls, args: MegatronModelArgs, vocab_multiple: int = 128) -> "ModelSpec":
        return cls(tuple(_model_tensors(args, vocab_multiple)), args.config_kwargs["num_layers"],
                   args.num_experts or 0, args.tie_word_embeddings)

    def index(self) -> Dict[str, int]:
        return {spec.key: i for i, spec in enumerate(self.tensors)}

    def numel(self) -> int:
        return sum(spec.numel for spec in self.tensors)

    def local_numel(self, tensors) -> int:
        """Elements of a list of :class:`LocalTensor`."""
        return sum(self.tensors[t.spec].slice_numel(t.shape[self.tensors[t.spec].split_dim]) for t in tensors)


def _model_tensors(args: MegatronModelArgs, vocab_multiple: int) -> List[TensorSpec]:
    kw = args.config_kwargs
    h, heads = kw["hidden_size"], kw["num_attention_heads"]
    vocab = padded_vocab_size(args.vocab_size, vocab_multiple)
    out = [TensorSpec("embedding.word_embeddings.weight", (vocab, h), 0, stage="first")]
    bias = bool(kw.get("add_bias_linear"))  # GptOss: q/k/v/o, router and experts
    if bias and (not kw.get("num_moe_experts") or 0 in kw["moe_layer_freq"]):
        raise NotImplementedError("biased dense MLPs are not planned (no supported family has them)")
    for layer in range(kw["num_layers"]):
        def add(suffix, shape, dim=None, blocks=1, expert=None, buffer=False):
            out.append(TensorSpec(f"decoder.layers.{layer}.{suffix}", tuple(shape), dim, blocks,
                                  "layer", layer, expert, buffer))

        add("input_layernorm.weight", (h,))
        attn = "self_attention."
        if kw.get("experimental_attention_variant") == "gated_delta_net" and kw["linear_attention_freq"][layer]:
            nk, nv = kw["linear_num_key_heads"], kw["linear_num_value_heads"]
            qk, v = nk * kw["linear_key_head_dim"], nv * kw["linear_value_head_dim"]
            add(attn + "dt_bias", (nv,), 0)  # the module's own parameters come before its children's
            add(attn + "A_log", (nv,), 0)
            add(attn + "in_proj.weight", (2 * qk + 2 * v + 2 * nv, h), 0, blocks=(qk, qk, v, v, nv, nv))
            add(attn + "conv1d.weight", (2 * qk + v, 1, kw["linear_conv_kernel_dim"]), 0, blocks=(qk, qk, v))
            add(attn + "out_norm.weight", (kw["linear_value_head_dim"],))
            add(attn + "out_proj.weight", (h, v), 1)
        elif args.mla:
            qk, rope, v = kw["qk_head_dim"], kw["qk_pos_emb_head_dim"], kw["v_head_dim"]
            if kw.get("q_lora_rank"):
                add(attn + "linear_q_down_proj.weight", (kw["q_lora_rank"], h), 0)
                add(attn + "linear_q_up_proj.weight", (heads * (qk + rope), kw["q_lora_rank"]), 0)
                add(attn + "q_layernorm.weight", (kw["q_lora_rank"],))
            else:
                add(attn + "linear_q_proj.weight", (heads * (qk + rope), h), 0)
            add(attn + "linear_kv_down_proj.weight", (kw["kv_lora_rank"] + rope, h), 0)
            add(attn + "linear_kv_up_proj.weight", (heads * (qk + v), kw["kv_lora_rank"]), 0)
            add(attn + "kv_layernorm.weight", (kw["kv_lora_rank"],))
            add(attn + "linear_proj.weight", (h, heads * v), 1)
        else:
            d, groups = kw["kv_channels"], kw["num_query_groups"]
            # grouped [q of group; (their gates;) k; v]: tp splits whole groups
            qkv = (heads * (2 if kw.get("attention_output_gate") else 1) + 2 * groups) * d
            add(attn + "linear_qkv.weight", (qkv, h), 0)
            if kw.get("add_qkv_bias") or bias:
                add(attn + "linear_qkv.bias", (qkv,), 0)
            if kw.get("qk_layernorm"):
                add(attn + "q_layernorm.weight", (d,))
                add(attn + "k_layernorm.weight", (d,))
            if kw.get("softmax_type") == "learnable":  # attention sinks: one logit per head
                add(attn + "core_attention.softmax_offset", (heads,), 0)
            add(attn + "linear_proj.weight", (h, heads * d), 1)
            if bias:  # a row-parallel layer's bias is whole on every tp rank
                add(attn + "linear_proj.bias", (h,))
        add("pre_mlp_layernorm.weight", (h,))
        num_experts = kw.get("num_moe_experts") or 0
        if not num_experts or kw["moe_layer_freq"][layer] == 0:
            ffn = kw["ffn_hidden_size"]
            add("mlp.linear_fc1.weight", (2 * ffn, h), 0, blocks=2)
            add("mlp.linear_fc2.weight", (h, ffn), 1)
            continue
        add("mlp.router.weight", (num_experts, h))
        if bias:
            add("mlp.router.bias", (num_experts,))
        if kw.get("moe_router_enable_expert_bias"):
            add("mlp.router.expert_bias", (num_experts,), buffer=True)
        ffn = kw["moe_ffn_hidden_size"]
        for e in range(num_experts):
            add(f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * ffn, h), 0, blocks=2, expert=e)
            add(f"mlp.experts.local_experts.{e}.linear_fc2.weight", (h, ffn), 1, expert=e)
            if bias:
                add(f"mlp.experts.local_experts.{e}.linear_fc1.bias", (2 * ffn,), 0, blocks=2, expert=e)
                add(f"mlp.experts.local_experts.{e}.linear_fc2.bias", (h,), expert=e)
        if kw.get("moe_shared_expert_intermediate_size"):
            shared = kw["moe_shared_expert_intermediate_size"]
            add("mlp.shared_experts.linear_fc1.weight", (2 * shared, h), 0, blocks=2)
            add("mlp.shared_experts.linear_fc2.weight", (h, shared), 1)
        if kw.get("moe_shared_expert_gate"):
            add("mlp.shared_experts.gate_weight", (1, h))
    out.append(TensorSpec("decoder.final_layernorm.weight", (h,), None, stage="last"))
    if not args.tie_word_embeddings:
        out.append(TensorSpec("output_layer.weight", (vocab, h), 0, stage="last"))
    return out


def slice_pieces(spec: TensorSpec, parts: int, index: int) -> Tuple[Piece, ...]:
    """The pieces of slice ``index`` of ``parts`` (each fused block split on its own)."""
    if spec.dim is None:
        parts, index = 1, 0
    pieces, local = [], 0
    for start, size in spec.block_bounds():
        part = size // parts
        pieces.append(Piece(start + index * part, start + (index + 1) * part, local))
        local += part
    return tuple(pieces)


class Placement:
    """Where each tensor lives in one layout: stage and chunk of each layer, local names."""

    def __init__(self, model: ModelSpec, layout: Layout):
        self.model, self.layout = model, layout
        chunks = layout.pp * (layout.vpp or 1)
        self.per_chunk = model.num_layers // chunks
        self.experts_per_rank = model.num_experts // layout.ep if model.num_experts else 0

    def layer_home(self, layer: int) -> Tuple[int, int, int]:
        """(pp rank, model chunk, local layer index): Megatron's interleaved assignment."""
        k = layer // self.per_chunk
        return k % self.layout.pp, k // self.layout.pp, layer % self.per_chunk

    def homes(self, spec: TensorSpec) -> List[Tuple[int, int, str]]:
        """(pp rank, chunk, local name) of every stage holding ``spec``."""
        last_pp, last_chunk = self.layout.pp - 1, (self.layout.vpp or 1) - 1
        if spec.stage == "first":
            homes = [(0, 0, spec.key)]
            if self.model.tied_embeddings and self.layout.pp > 1:  # the last stage's output copy
                homes.append((last_pp, last_chunk, "output_layer.weight"))
            return homes
        if spec.stage == "last":
            return [(last_pp, last_chunk, spec.key)]
        pp, chunk, local = self.layer_home(spec.layer)
        rest = spec.key.split(".", 3)[3]  # after "decoder.layers.{L}."
        if spec.expert is not None:
            rest = rest.replace(f"local_experts.{spec.expert}.",
                                f"local_experts.{spec.expert % self.experts_per_rank}.")
        return [(pp, chunk, f"decoder.layers.{local}.{rest}")]

    def expert_owner(self, spec: TensorSpec) -> int:
        return spec.expert // self.experts_per_rank

    def split(self, spec: TensorSpec, coords: Dict[str, int]) -> Tuple[int, int]:
        """(parts, index) of the tensor-parallel split this rank holds."""
        if spec.expert is not None:
            return self.layout.etp, coords["etp"]
        return self.layout.tp, coords["tp"]

    def local_tensors(self, rank: int) -> List[LocalTensor]:
        """Every tensor ``rank`` holds, in model order."""
        coords = self.layout.coords(rank)
        out = []
        for i, spec in enumerate(self.model.tensors):
            if spec.expert is not None and self.expert_owner(spec) != coords["ep"]:
                continue
            for pp, chunk, name in self.homes(spec):
                if pp != coords["pp"]:
                    continue
                pieces = slice_pieces(spec, *self.split(spec, coords))
                local = sum(p.stop - p.start for p in pieces)
                shape = tuple(local if d == spec.split_dim else n for d, n in enumerate(spec.shape))
                out.append(LocalTensor(chunk, name, i, shape, pieces))
        return out

    def holders(self, spec: TensorSpec, parts_index: int) -> List[int]:
        """Every rank holding slice ``parts_index`` of ``spec`` (all its data-parallel replicas)."""
        return self._holders().get((spec.stage, spec.layer, spec.expert is not None,
                                    self.expert_owner(spec) if spec.expert is not None else 0,
                                    "all" if spec.dim is None else parts_index), [])

    def _holders(self) -> Dict[tuple, List[int]]:
        cache = getattr(self, "_holder_index", None)
        if cache is not None:
            return cache
        cache = {}
        layout = self.layout
        stages: Dict[Tuple[str, Optional[int]], List[int]] = {}
        for spec in self.model.tensors:
            stages.setdefault((spec.stage, spec.layer), [pp for pp, _, _ in self.homes(spec)])
        for rank in range(layout.world_size):
            c = layout.coords(rank)
            for (stage, layer), pps in stages.items():
                if c["pp"] not in pps:
                    continue
                cache.setdefault((stage, layer, False, 0, c["tp"]), []).append(rank)
                cache.setdefault((stage, layer, False, 0, "all"), []).append(rank)
                if stage == "layer" and self.experts_per_rank:
                    cache.setdefault((stage, layer, True, c["ep"], c["etp"]), []).append(rank)
                    # an expert tensor etp does not split (GptOss's linear_fc2 bias)
                    cache.setdefault((stage, layer, True, c["ep"], "all"), []).append(rank)
        self._holder_index = cache
        return cache
