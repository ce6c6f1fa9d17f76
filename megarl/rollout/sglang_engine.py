"""SGLang rollout for GPU clusters (optional extra ``sglang``), fed by the 3D-HybridEngine.

One SGLang engine per generation replica, started from the replica's generation-TP rank 0 on
the replica's GPUs with dummy weights and the memory saver. A weight update takes the hybrid
engine's generation shards, joins them over the generation TP group (SGLang's loaders take
whole Hugging Face tensors and shard them themselves), renames them with the HF mapping tables,
and hands them over bucket by bucket as CUDA-IPC handles, one payload per TP rank, through
``update_weights_from_tensor``: no host copy. Split placement uses ``init_weights_update_group``
and ``update_weights_from_distributed`` instead.

The parts that need no GPU (names, buckets, payload layout) are plain functions, tested on CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.checkpoint.hf_mapping import build_plan
from megarl.hybrid.shards import LocalTensor, ModelSpec
from megarl.models.hf_config import MegatronModelArgs
from megarl.rollout.types import Response, RolloutEngine, SamplingParams

NamedTensors = List[Tuple[str, torch.Tensor]]


def require_sglang():
    """Import SGLang or say which extra to install."""
    try:
        import sglang
    except ImportError as err:
        raise ImportError("rollout.engine=sglang needs SGLang on a GPU machine: pip install 'megarl[sglang]' "
                          "(or use rollout.engine=native, which runs everywhere)") from err
    return sglang


# ----------------------------------------------------------------------------- names


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


# ----------------------------------------------------------------------------- buckets and payloads


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


def buckets(named: NamedTensors, bucket_bytes: int) -> List[NamedTensors]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    out: List[NamedTensors] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return [b for b in out if b]


@dataclass(frozen=True)
class FlatEntry:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    start: int
    stop: int


def flatten(named: NamedTensors) -> Tuple[torch.Tensor, List[FlatEntry]]:
    """One flat buffer (of the first tensor's dtype) and where each tensor sits in it."""
    dtype = named[0][1].dtype
    entries, parts, offset = [], [], 0
    for name, tensor in named:
        if tensor.dtype != dtype:
            raise ValueError(f"bucket mixes {dtype} and {tensor.dtype} ('{name}'); bucket by dtype")
        parts.append(tensor.reshape(-1))
        entries.append(FlatEntry(name, tuple(tensor.shape), dtype, offset, offset + tensor.numel()))
        offset += tensor.numel()
    return torch.cat(parts), entries


def unflatten(flat: torch.Tensor, entries: Sequence[FlatEntry]) -> NamedTensors:
    return [(e.name, flat[e.start:e.stop].view(e.shape)) for e in entries]


def payloads_by_name(per_rank: Sequence[Sequence[Tuple[str, object]]]) -> List[Tuple[str, List[object]]]:
    """[tp rank][tensor] (name, payload) → [tensor] (name, [payload of tp rank 0, 1, ...]): what
    SGLang's ``LocalSerializedTensor`` takes, each TP worker picking its own."""
    out = []
    for group in zip(*per_rank, strict=True):
        names = {name for name, _ in group}
        if len(names) != 1:
            raise ValueError(f"TP ranks disagree on the tensor order: {sorted(names)}")
        out.append((group[0][0], [payload for _, payload in group]))
    return out


# ----------------------------------------------------------------------------- the engine (GPU)


class SGLangRollout(RolloutEngine):
    """SGLang engines of the generation replicas, weights from a hybrid-engine ``Resharder``.

    ``groups`` are the generation layout's process groups (``build_placed_groups``);
    ``hf_dir`` holds the HF ``config.json`` and tokenizer files SGLang starts from (weights are
    dummies until the first ``update_weights``). Needs CUDA and the ``sglang`` extra.
    """

    def __init__(self, resharder, model: ModelSpec, args: MegatronModelArgs, groups, hf_dir: str,
                 mem_fraction: float = 0.5, bucket_bytes: int = 512 << 20, port: int = 30000):
        sglang = require_sglang()
        if not torch.cuda.is_available():
            raise RuntimeError("the sglang rollout needs CUDA GPUs")
        self.resharder, self.model, self.groups = resharder, model, groups
        self.names = HFNames(args)
        self.bucket_bytes = bucket_bytes
        self.tp_rank = groups.pg.tp.rank()
        self.engine = None
        if self.tp_rank == 0:
            self.engine = sglang.Engine(
                model_path=hf_dir, tp_size=groups.layout.tp, base_gpu_id=torch.cuda.current_device(),
                load_format="dummy", enable_memory_saver=True, skip_tokenizer_init=True,
                mem_fraction_static=mem_fraction, host="127.0.0.1", port=port + groups.pg.dp.rank(),
                dtype="bfloat16" if resharder.dtypes[0] == torch.bfloat16 else "float32")

    def _whole_tensors(self) -> NamedTensors:
        """The generation shards joined over the generation TP group, under HF names."""
        gen = self.resharder.plan.gen[dist.get_rank()]
        tp = self.groups.layout.tp
        out: NamedTensors = []
        for local in gen:
            spec = self.model.tensors[local.spec]
            shard = self.resharder.outputs[local.name]
            if spec.dim is None or tp == 1:
                whole = shard
            else:
                parts = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(parts, shard.contiguous(), group=self.groups.pg.tp)
                tp_ranks = dist.get_process_group_ranks(self.groups.pg.tp)
                locals_ = [next(t for t in self.resharder.plan.gen[r] if t.spec == local.spec) for r in tp_ranks]
                whole = assemble(parts, locals_, spec.split_dim, spec.shape[spec.split_dim])
            out += self.names(spec.key, whole)
        return out

    def update_weights(self, policy_version: int) -> None:
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer

        self.resharder.sync()
        tp_ranks = dist.get_process_group_ranks(self.groups.pg.tp)
        for bucket in buckets(self._whole_tensors(), self.bucket_bytes):
            mine = [(name, MultiprocessingSerializer.serialize(t.detach())) for name, t in bucket]
            gathered = [None] * len(tp_ranks) if self.tp_rank == 0 else None
            dist.gather_object(mine, gathered, dst=tp_ranks[0], group=self.groups.pg.tp)
            if self.engine is not None:
                named = [(name, LocalSerializedTensor(values=values)) for name, values in payloads_by_name(gathered)]
                self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False)
            dist.barrier(group=self.groups.pg.tp)  # keep the IPC handles alive until loaded
        if self.engine is not None:
            self.engine.flush_cache()
        self.policy_version = policy_version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        rows = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
        dp, dp_rank = self.groups.layout.dp, self.groups.pg.dp.rank()
        share = -(-len(rows) // dp)
        mine = rows[dp_rank * share:(dp_rank + 1) * share]
        out: List[Response] = []
        if self.engine is not None and mine:
            params = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                      "top_k": sampling.top_k or -1, "max_new_tokens": sampling.max_new_tokens,
                      "stop_token_ids": list(sampling.stop_token_ids)}
            if sampling.seed is not None:
                params["sampling_seed"] = sampling.seed
            results = self.engine.generate(input_ids=[list(prompts[p]) for p, _ in mine], sampling_params=params,
                                           return_logprob=True)
            for (p, s), result in zip(mine, results):
                meta = result["meta_info"]
                logps = [lp for lp, _, _ in meta["output_token_logprobs"]]
                reason = meta["finish_reason"]["type"] if meta.get("finish_reason") else "length"
                out.append(Response(p, s, list(result["output_ids"]), logps,
                                    "stop" if reason == "stop" else "length", self.policy_version))
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        seen, merged = set(), []
        for part in parts:
            for r in part:
                if (r.prompt_index, r.sample_index) not in seen:
                    seen.add((r.prompt_index, r.sample_index))
                    merged.append(r)
        return sorted(merged, key=lambda r: (r.prompt_index, r.sample_index))

    def release_memory(self) -> None:
        if self.engine is not None:
            self.engine.release_memory_occupation()
        dist.barrier()

    def resume_memory(self) -> None:
        if self.engine is not None:
            self.engine.resume_memory_occupation()
        self.resharder.versions.clear()
        dist.barrier()

    def flush_cache(self) -> None:
        if self.engine is not None:
            self.engine.flush_cache()

    def connect_distributed(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            group_name: str = "megarl-weights") -> None:
        """Split placement: join a NCCL group with the trainer's ranks for weight broadcasts."""
        if self.engine is not None:
            self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                  group_name, backend="nccl")

    def update_weights_distributed(self, names: List[str], dtypes: List[torch.dtype], shapes: List[List[int]],
                                   group_name: str = "megarl-weights") -> None:
        """Split placement: receive a bucket broadcast by the trainer over the weights group."""
        if self.engine is not None:
            self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name)
