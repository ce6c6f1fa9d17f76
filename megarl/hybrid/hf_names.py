"""Whole Megatron tensors under Hugging Face names, through the converters' mapping tables: what
SGLang's (and vLLM's) loaders take. Also joins the generation-TP shards of one tensor."""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

import torch

from megarl.models.hf_mapping import build_plan
from megarl.hybrid.shards import LocalTensor
from megarl.models.hf_config import MegatronModelArgs

NamedTensors = List[Tuple[str, torch.Tensor]]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


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
        self.items = {(item.mcore_key, item.expert): item for item in plan.items}

    def __call__(self, key: str, tensor: torch.Tensor) -> NamedTensors:
        ckpt, expert = checkpoint_key(key, self.mla)
        item = self.items.get((ckpt, expert))
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


def joined_hf_tensors(shard: Sequence[LocalTensor], outputs, model, names: HFNames, tp_group,
                      shard_of) -> NamedTensors:
    """This rank's generation shard (``shard``: its local tensors; ``outputs``: local name ->
    tensor) joined over the generation TP group ``tp_group`` into whole tensors under HF names.
    ``shard_of(rank)``: the local tensors of global rank ``rank``'s shard. Collective over the group."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group)
    tp_ranks = dist.get_process_group_ranks(tp_group)
    out: NamedTensors = []
    for local in shard:
        spec = model.tensors[local.spec]
        piece = outputs[local.name]
        if spec.dim is None or tp == 1:
            whole = piece
        else:
            parts = [torch.empty_like(piece) for _ in range(tp)]
            dist.all_gather(parts, piece.contiguous(), group=tp_group)
            locals_ = [next(t for t in shard_of(r) if t.spec == local.spec) for r in tp_ranks]
            whole = assemble(parts, locals_, spec.split_dim, spec.shape[spec.split_dim])
        out += names(spec.key, whole)
    return out


_HF_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def layer_buckets(named: NamedTensors, bucket_bytes: int) -> List[NamedTensors]:
    """Consecutive buckets of at most ``bucket_bytes`` that never split a decoder layer (a layer
    larger than the bucket goes alone): engines that fuse a layer's tensors on load (vLLM's
    QKV and gate/up, processed once the whole layer has arrived) get whole layers."""
    groups: List[NamedTensors] = []
    key = object()
    for name, tensor in named:
        m = _HF_LAYER.match(name)
        this = m.group(1) if m else name
        if not groups or this != key:
            groups.append([])
            key = this
        groups[-1].append((name, tensor))
    out: List[NamedTensors] = []
    size = bucket_bytes + 1
    for group in groups:
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if out and size + nbytes <= bucket_bytes:
            out[-1] += group
            size += nbytes
        else:
            out.append(list(group))
            size = nbytes
    return out
