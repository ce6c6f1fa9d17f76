"""Whole Megatron tensors under Hugging Face names, through the converters' mapping tables: what
SGLang's (and vLLM's) loaders take. Also joins the generation-TP shards of one tensor, and plans
whole-layer buckets of a generation shard from its tensors' metadata."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megarl.models.hf_mapping import build_plan
from megarl.hybrid.shards import LocalTensor, TensorSpec
from megarl.models.hf_config import MegatronModelArgs, UnsupportedModelError

NamedTensors = List[Tuple[str, torch.Tensor]]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_FUSED_INPUT_NORM = "self_attention.linear_qkv.layer_norm_weight"


def checkpoint_key(key: str, mla: bool) -> Tuple[str, Optional[int]]:
    """A tensor's key in a single-process model → its dist-checkpoint key (the HF tables' names)
    and expert index. The local layer spec keeps norms apart; the checkpoint fuses them into the
    next linear layer's name, as Transformer Engine does (MLA keeps its own names)."""
    m = _LAYER.match(key)
    if not m:
        return key, None
    layer, rest = m.groups()
    if not mla and rest == "input_layernorm.weight":
        rest = "self_attention.linear_qkv.layer_norm_weight"
    elif not mla and rest == "pre_mlp_layernorm.weight":
        rest = "mlp.linear_fc1.layer_norm_weight"
    e = _EXPERT.match(rest)
    if e:
        return f"decoder.layers.{layer}.mlp.experts.experts.{e.group(2)}", int(e.group(1))
    return f"decoder.layers.{layer}.{rest}", None


class HFNames:
    """Whole Megatron tensors (single-process keys) → Hugging Face names and tensors, through the
    converters' mapping tables (the same transforms: QKV, gate/up, vocabulary padding)."""

    def __init__(self, args: MegatronModelArgs, vocab_multiple: int = 128):
        self.mla = args.mla
        plan = build_plan(args, vocab_multiple)
        stacked = next((item for item in plan.items if item.rule.stacked), None)
        if stacked is not None:
            # one HF tensor holds every expert of a layer (GptOss's experts.gate_up_proj): the
            # engines' weight sync hands over one expert at a time, which has no HF name
            raise UnsupportedModelError(
                f"{args.model_type}: syncing weights to SGLang/vLLM is not supported, its HF checkpoint "
                f"stacks all experts in one tensor ('{stacked.hf_names[0]}'); use rollout.engine=native, "
                f"or convert the checkpoint offline (megarl convert)")
        # a tensor Megatron's checkpoint keeps in parts (the gated delta net's in_proj, conv1d) is
        # whole here: its rule's transform takes it whole
        self.items = {}
        for item in plan.items:
            key = item.mcore_key if item.part is None else item.mcore_key[: -len(item.part) - 1]
            self.items.setdefault((key, item.expert), item)

    def __call__(self, key: str, tensor: torch.Tensor) -> NamedTensors:
        ckpt, expert = checkpoint_key(key, self.mla)
        item = self.items.get((ckpt, expert))
        if item is None and ckpt.endswith(_FUSED_INPUT_NORM):  # a gated delta net's input norm
            item = self.items.get((ckpt[: -len(_FUSED_INPUT_NORM)] + "self_attention.in_proj.layer_norm_weight", expert))
        if item is None:
            raise KeyError(f"no HF name for Megatron tensor '{key}' (checkpoint key '{ckpt}')")
        return list(zip(item.hf_names, item.rule.transform.to_hf(tensor)))



def assemble(shards: Sequence[torch.Tensor], locals_: Sequence[LocalTensor], spec_dim: int, full_size: int) -> torch.Tensor:
    """The whole tensor from the generation-TP shards of one tensor (rank order), each with its
    pieces (fused blocks included)."""
    first = shards[0]
    shape = list(first.shape)
    shape[spec_dim] = full_size
    out = first.new_empty(shape)
    for shard, local in zip(shards, locals_):
        for p in local.pieces:
            out.narrow(spec_dim, p.start, p.stop - p.start).copy_(shard.narrow(spec_dim, p.local_start, p.stop - p.start))
    return out


def join_tensor(local: LocalTensor, outputs, model, tp_group, shard_of) -> torch.Tensor:
    """One local tensor of this rank's generation shard (``outputs``: local name -> tensor), whole:
    gathered over the generation TP group ``tp_group`` and assembled (collective over the group for a
    split tensor). ``shard_of(rank)``: the local tensors of global rank ``rank``'s shard."""
    import torch.distributed as dist

    spec = model.tensors[local.spec]
    piece = outputs[local.name]
    tp = dist.get_world_size(tp_group)
    if spec.dim is None or tp == 1:
        return piece
    parts = [torch.empty_like(piece) for _ in range(tp)]
    dist.all_gather(parts, piece.contiguous(), group=tp_group)
    locals_ = [next(t for t in shard_of(r) if t.spec == local.spec) for r in dist.get_process_group_ranks(tp_group)]
    return assemble(parts, locals_, spec.split_dim, spec.shape[spec.split_dim])


def join_bytes(spec: TensorSpec, tp: int, itemsize: int) -> int:
    """Bytes the join of ``spec`` over ``tp`` ranks holds at its peak (elements of ``itemsize``
    bytes): the gathered parts and the assembled tensor; none for a tensor it does not gather."""
    return 0 if spec.dim is None or tp == 1 else 2 * spec.numel * itemsize


def joined_hf_tensors(shard: Sequence[LocalTensor], outputs, model, names: HFNames, tp_group,
                      shard_of) -> NamedTensors:
    """This rank's generation shard (``shard``: its local tensors; ``outputs``: local name ->
    tensor) joined over the generation TP group ``tp_group`` into whole tensors under HF names.
    ``shard_of(rank)``: the local tensors of global rank ``rank``'s shard. Collective over the group."""
    out: NamedTensors = []
    for local in shard:
        out += names(model.tensors[local.spec].key, join_tensor(local, outputs, model, tp_group, shard_of))
    return out


def layer_group(spec: TensorSpec) -> Tuple[str, object]:
    """What a tensor is handed over with: its decoder layer (all of the layer's tensors), or itself
    (embedding, final norm, output layer)."""
    return ("layer", spec.layer) if spec.layer is not None else ("tensor", spec.key)


def shard_buckets(shard: Sequence[LocalTensor], model, itemsize: int, bucket_bytes: int) -> List[List[LocalTensor]]:
    """The local tensors of a generation shard in buckets of at most ``bucket_bytes`` once whole
    (``spec.numel`` elements of ``itemsize`` bytes: the engine's dtype), planned from the tensors'
    metadata alone, so every generation-TP rank plans the same buckets before building any tensor.
    A bucket never splits a decoder layer (engines that fuse a layer's tensors on load, vLLM's QKV,
    gate/up and MoE experts, process the layer once all of it has arrived); consecutive layers are
    packed together, a layer larger than the bucket goes alone."""
    groups: Dict[Tuple[str, object], List[LocalTensor]] = {}
    for local in shard:
        groups.setdefault(layer_group(model.tensors[local.spec]), []).append(local)
    out: List[List[LocalTensor]] = []
    size = bucket_bytes + 1
    for group in groups.values():
        nbytes = sum(model.tensors[local.spec].numel for local in group) * itemsize
        if out and size + nbytes <= bucket_bytes:
            out[-1] += group
            size += nbytes
        else:
            out.append(list(group))
            size = nbytes
    return out
