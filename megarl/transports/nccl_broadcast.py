"""Split-placement weight sync to SGLang: whole HF tensors broadcast from the trainer's rank 0.

Trainer and rollout agree on the weights, bucket by bucket, without talking: both derive the
list from the model alone (:func:`hf_bucket_plan`). The trainer's :class:`SGLangBroadcaster`
gathers each bucket's whole tensors on its rank 0 and broadcasts them over a process group that
spans it and SGLang's TP workers (:func:`weights_process_group` on the trainer,
``init_weights_update_group`` in SGLang); :class:`BroadcastReceiver` posts the matching receives
(``update_weights_from_distributed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid.executor import SyncStats
from megarl.hybrid.names import check_planned, planned_tensors
from megarl.hybrid.shards import LocalTensor, ModelSpec, Placement, TensorSpec
from megarl.models.hf_config import MegatronModelArgs
from megarl.parallel import Layout
from megarl.hybrid.hf_names import HFNames, NamedTensors, assemble
from megarl.transports import WeightSender

WEIGHTS_GROUP = "megarl-weights"  # split placement: the trainer's rank 0 and SGLang's workers


@dataclass(frozen=True)
class HFTensor:
    """One whole Hugging Face tensor as the rollout receives it."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class WeightBucket:
    """Consecutive Megatron tensors (single-process keys) and the HF tensors they become, in order."""

    keys: Tuple[str, ...]
    tensors: Tuple[HFTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.dtype.itemsize * _numel(t.shape) for t in self.tensors)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def hf_bucket_plan(args: MegatronModelArgs, dtype: torch.dtype, bucket_bytes: int,
                   vocab_multiple: int = 128) -> List[WeightBucket]:
    """Every weight of the model as whole HF tensors of ``dtype``, in model order, cut into buckets
    of at most ``bucket_bytes`` (a Megatron tensor larger than that goes alone; the HF tensors of
    one Megatron tensor, e.g. q, k, v, stay in one bucket). Pure and deterministic: the trainer's
    sender and the rollout's receiver each compute it and get the same list."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    names = HFNames(args, vocab_multiple)
    out: List[WeightBucket] = []
    keys: List[str] = []
    tensors: List[HFTensor] = []
    size = 0
    for spec in ModelSpec.from_args(args, vocab_multiple).tensors:
        # the mapping's transforms only reshape and slice: meta tensors give the HF shapes
        hf = [HFTensor(n, tuple(t.shape), dtype) for n, t in names(spec.key, torch.empty(spec.shape, device="meta"))]
        nbytes = sum(dtype.itemsize * _numel(t.shape) for t in hf)
        if keys and size + nbytes > bucket_bytes:
            out.append(WeightBucket(tuple(keys), tuple(tensors)))
            keys, tensors, size = [], [], 0
        keys.append(spec.key)
        tensors += hf
        size += nbytes
    if keys:
        out.append(WeightBucket(tuple(keys), tuple(tensors)))
    return out


def weights_process_group(address: str, port: int, rank: int, world_size: int, group_name: str,
                          backend: str = "nccl", timeout: timedelta = timedelta(minutes=30)):
    """A process group outside this process's own world, joined by rendezvous at
    ``tcp://address:port`` (rank 0 hosts the store) with its keys under ``group_name``: the way
    SGLang's TP workers join theirs in ``init_weights_update_group``, so the trainer's rank 0
    (rank 0 here) and SGLang's workers (ranks 1...) meet in one group. Use the returned
    ProcessGroup's own methods (its ranks are not this world's)."""
    from torch.distributed import distributed_c10d

    # The store torch's tcp:// rendezvous makes (SGLang's side), built directly: under torchrun,
    # rendezvous would hand back the launcher's store instead.
    from megarl.runtime.distributed import bound_store

    store = bound_store(address, port, world_size, rank, timeout)  # the master listens on ``address`` only
    # the store's key prefix must be SGLang's (group_name); the name torch registers it under is
    # this process's own and must be new each time (a process may join several such groups)
    group, _ = distributed_c10d._new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), dist.PrefixStore(group_name, store),
        group_name=f"{group_name}@{address}:{port}", timeout=timeout)
    return group


def broadcast_from_root(group, tensor: torch.Tensor):
    """Broadcast ``tensor`` from rank 0 of ``group`` (a :func:`weights_process_group`); async work."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return group.broadcast([tensor], opts)


@dataclass
class BroadcastStats:
    """What one split-placement sync did on this trainer rank."""

    bytes_sent: int = 0  # to rank 0 (the gathers), or broadcast (rank 0)
    tensors: int = 0
    seconds: float = 0.0


class SGLangBroadcaster:
    """Trainer side of the split placement's weight sync to SGLang.

    For each bucket of the plan, the whole Megatron tensors are gathered on the training world's
    rank 0, each tensor-parallel slice once, point to point from the lowest rank that holds it (its
    tp/etp shard on the pipeline stage and expert rank that hold the layer); rank 0 turns them into
    HF tensors and broadcasts them over the weights group. Collective over the training world;
    ``weights_group`` is needed on rank 0 only.
    """

    def __init__(self, args: MegatronModelArgs, layout: Layout, train_chunks: List[torch.nn.Module],
                 plan: Sequence[WeightBucket], vocab_multiple: int = 128):
        self.plan = list(plan)
        self.model = ModelSpec.from_args(args, vocab_multiple)
        self.names = HFNames(args, vocab_multiple)
        self.rank = dist.get_rank()
        placement = Placement(self.model, layout)
        index = self.model.index()
        # plan names, whether the model was built from the local or Transformer Engine's spec
        named = [planned_tensors(c) for c in train_chunks]
        check_planned(train_chunks, placement.local_tensors(self.rank), f"rank {self.rank}")
        self.mine: Dict[int, Tuple[LocalTensor, torch.Tensor]] = {}
        for local in placement.local_tensors(self.rank):
            tensor = named[local.chunk].get(local.name)
            if tensor is None or tuple(tensor.shape) != local.shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"rank {self.rank}: training tensor '{local.name}' (chunk {local.chunk}) is {got}, "
                                 f"layout {layout} expects {local.shape}")
            self.mine.setdefault(local.spec, (local, tensor.detach()))
        # per spec: [(holder rank, pieces of its slice)], slice order; the same on every rank
        self.sources: Dict[int, List[Tuple[int, LocalTensor]]] = {}
        locals_by_rank: Dict[int, Dict[int, LocalTensor]] = {}
        for bucket in self.plan:
            for key in bucket.keys:
                if key not in index:
                    raise ValueError(f"bucket plan names '{key}', which the model does not have")
                spec_index = index[key]
                spec = self.model.tensors[spec_index]
                parts = 1 if spec.dim is None else (layout.etp if spec.expert is not None else layout.tp)
                sources = []
                for i in range(parts):
                    holder = min(placement.holders(spec, i))
                    if holder not in locals_by_rank:
                        locals_by_rank[holder] = {t.spec: t for t in reversed(placement.local_tensors(holder))}
                    sources.append((holder, locals_by_rank[holder][spec_index]))
                self.sources[spec_index] = sources
        self.index = index
        self.device = next(iter(self.mine.values()))[1].device
        self.last = BroadcastStats()
        # batch_isend_irecv needs the world's communicator set up by a call every rank joins
        dist.barrier()

    @torch.no_grad()
    def gather(self, bucket: WeightBucket) -> NamedTensors:
        """The bucket's whole HF tensors on rank 0 (checked against the plan), [] elsewhere."""
        ops, received = [], {}
        for key in bucket.keys:
            spec_index = self.index[key]
            for i, (holder, local) in enumerate(self.sources[spec_index]):
                if holder == self.rank and self.rank != 0:
                    ops.append(dist.P2POp(dist.isend, self.mine[spec_index][1].contiguous(), 0))
                    self.last.bytes_sent += self.mine[spec_index][1].numel() * self.mine[spec_index][1].element_size()
                elif self.rank == 0 and holder != 0:
                    buf = torch.empty(local.shape, dtype=self._dtype(spec_index), device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buf, holder))
                    received[(spec_index, i)] = buf
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if self.rank != 0:
            return []
        out: NamedTensors = []
        for key in bucket.keys:
            spec_index = self.index[key]
            spec: TensorSpec = self.model.tensors[spec_index]
            sources = self.sources[spec_index]
            shards = [self.mine[spec_index][1] if holder == 0 else received[(spec_index, i)]
                      for i, (holder, _) in enumerate(sources)]
            whole = shards[0] if len(shards) == 1 else assemble(
                shards, [local for _, local in sources], spec.split_dim, spec.shape[spec.split_dim])
            out += self.names(key, whole)
        planned = [(t.name, t.shape) for t in bucket.tensors]
        got = [(name, tuple(t.shape)) for name, t in out]
        if got != planned:
            raise AssertionError(f"bucket tensors {got[:3]}... differ from the plan's {planned[:3]}...")
        return [(name, t.to(meta.dtype)) for (name, t), meta in zip(out, bucket.tensors)]

    def _dtype(self, spec_index: int) -> torch.dtype:
        """The training dtype of a tensor rank 0 does not hold: that of one it holds of the same
        kind (Megatron keeps all parameters in one dtype; buffers such as expert biases in fp32)."""
        buffer = self.model.tensors[spec_index].buffer
        for spec, (_, tensor) in self.mine.items():
            if self.model.tensors[spec].buffer == buffer:
                return tensor.dtype
        return torch.float32

    def send(self, weights_group=None) -> BroadcastStats:
        """One sync: every bucket gathered, then broadcast from rank 0 over ``weights_group``
        (a :func:`weights_process_group`, rank 0 only), in plan order."""
        start = time.perf_counter()
        self.last = BroadcastStats()
        if self.rank == 0 and weights_group is None:
            raise ValueError("rank 0 sends the weights: pass the weights group (weights_process_group)")
        for bucket in self.plan:
            named = self.gather(bucket)
            works = [broadcast_from_root(weights_group, t) for _, t in named]
            for work in works:
                work.wait()
            self.last.tensors += len(named)
            if self.rank == 0:
                self.last.bytes_sent += sum(t.numel() * t.element_size() for _, t in named)
        self.last.seconds = time.perf_counter() - start
        return self.last


class BroadcastSender(WeightSender):
    """A training rank's side: rank 0 joins the weights group and broadcasts; every rank sends
    it its slices (``nproc``: the rollout's ranks, SGLang's TP workers)."""

    def __init__(self, broadcaster: SGLangBroadcaster, nproc: int):
        self.broadcaster, self.nproc = broadcaster, nproc
        self.weights_group = None

    def connect(self, address: str, port: int) -> None:
        if dist.get_rank() == 0:
            self.weights_group = weights_process_group(address, port, 0, 1 + self.nproc, WEIGHTS_GROUP)

    def send(self) -> int:
        return self.broadcaster.send(self.weights_group).bytes_sent


class BroadcastReceiver:
    """The rollout's side, driving this replica's SGLang engine (``engine``: the handle on its
    generation-TP rank 0, else None) through SGLang's own group and receives."""

    in_process = False  # the rollout keeps its own devices

    def __init__(self, plan: Sequence[WeightBucket], groups):
        self.plan, self.groups = list(plan), groups
        self.last = SyncStats()

    def connect(self, engine, address: str, port: int, group_name: str = WEIGHTS_GROUP) -> None:
        """Join the weights group whose rank 0 is the trainer's rank 0 (it calls
        :func:`weights_process_group` with the same address, port and name at the same time). The
        TP workers of replica d are ranks 1 + d*tp ... of 1 + dp*tp."""
        tp, dp = self.groups.layout.tp, self.groups.layout.dp
        if engine is not None:
            engine.init_weights_update_group(address, port, 1 + self.groups.pg.dp.rank() * tp, 1 + dp * tp,
                                             group_name, backend="nccl")

    def sync(self, engine, group_name: str = WEIGHTS_GROUP) -> None:
        """Take one sync's buckets as the trainer's :class:`SGLangBroadcaster` sends them (the same
        :func:`hf_bucket_plan`), then drop the stale prefix cache."""
        start = time.perf_counter()
        if engine is not None:
            for bucket in self.plan:
                engine.update_weights_from_distributed(
                    names=[t.name for t in bucket.tensors], dtypes=[str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
                    shapes=[list(t.shape) for t in bucket.tensors], group_name=group_name, flush_cache=False)
            engine.flush_cache()
        dist.barrier()
        self.last = SyncStats(bytes_received=sum(b.nbytes for b in self.plan), seconds=time.perf_counter() - start)
