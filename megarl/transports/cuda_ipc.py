"""Colocated hand-over to SGLang without a host copy: the hybrid engine's generation shards are
joined over the generation TP group into whole HF tensors and given to the engine bucket by
bucket as CUDA-IPC handles, one payload per TP rank (``update_weights_from_tensor``). The
bucketing and payload layout are plain functions, tested on CPU.

The handles are SGLang's own: its ``MultiprocessingSerializer`` with its
``monkey_patch_torch_reductions`` applied in this process (as SGLang's
``sglang.srt.weight_sync.utils.update_weights`` does), so that a handle names its GPU by uuid.
torch's reduction writes the sender's device ordinal, which names another GPU in SGLang's TP
worker: a Ray worker's GPU is its device 0, and TP worker i sees the engine's GPUs with its own at
ordinal i. SGLang's workers apply the same patch, mapping the uuid back to their own ordinal.
SGLang's helper itself is not used: it is a coroutine over a DeviceMesh that passes a request
object where ``Engine.update_weights_from_tensor`` (0.5.6.post2) takes named tensors."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid.shards import ModelSpec
from megarl.hybrid.hf_names import HFNames, NamedTensors, joined_hf_tensors


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


class CudaIpcSender:
    """Sends the generation shards that ``resharder`` (the colocated micro-DP executor) holds to
    the SGLang engine of this replica, whose handle only the generation-TP rank 0 has
    (``engine``, else None). ``groups``: the generation layout's process groups."""

    in_process = True  # shares the trainer's devices: the engine's memory is released between phases

    def __init__(self, resharder, groups, model: ModelSpec, names: HFNames, bucket_bytes: int):
        self.resharder, self.groups, self.model, self.names = resharder, groups, model, names
        self.bucket_bytes = bucket_bytes
        self.tp_rank = groups.pg.tp.rank()

    @property
    def last(self):
        """What the last sync did on this rank (megarl.hybrid.SyncStats)."""
        return self.resharder.last

    def connect(self, engine, address: str, port: int) -> None:
        """Nothing to join: the hand-over is in process."""

    def whole_tensors(self) -> NamedTensors:
        """The generation shards joined over the generation TP group, under HF names."""
        plan = self.resharder.plan
        return joined_hf_tensors(plan.gen[dist.get_rank()], self.resharder.outputs, self.model, self.names,
                                 self.groups.pg.tp, lambda r: plan.gen[r])

    def sync(self, engine) -> None:
        """One sync: reshard in process, then every bucket to ``engine``; the sync's seconds
        include the hand-over, not only the reshard."""
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # handles by GPU uuid (see the module docstring); once per process
        start = time.perf_counter()
        self.resharder.sync()
        tp_ranks = dist.get_process_group_ranks(self.groups.pg.tp)
        for bucket in buckets(self.whole_tensors(), self.bucket_bytes):
            mine = [(name, MultiprocessingSerializer.serialize(t.detach())) for name, t in bucket]
            gathered = [None] * len(tp_ranks) if self.tp_rank == 0 else None
            dist.gather_object(mine, gathered, dst=tp_ranks[0], group=self.groups.pg.tp)
            if engine is not None:
                named = [(name, LocalSerializedTensor(values=values)) for name, values in payloads_by_name(gathered)]
                engine.update_weights_from_tensor(named_tensors=named, flush_cache=False)
            dist.barrier(group=self.groups.pg.tp)  # keep the IPC handles alive until loaded
        if engine is not None:
            engine.flush_cache()
        self.resharder.release()  # the engine holds the weights: the generation shard's buffers go
        self.resharder.last.seconds = time.perf_counter() - start
