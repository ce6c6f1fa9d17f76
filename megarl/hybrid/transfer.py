"""Weight sync of split placement: the actor's training ranks send, the rollout's own ranks receive.

Trainer and rollout are two worker groups, each its own ``torch.distributed`` world with its
own Megatron layout. A third process group spans both (:func:`connect`): training rank ``r`` is
its rank ``r``, rollout rank ``v`` is ``trainer_world + v``. :func:`plan_transfer` lists, for
every rollout rank, the ranges of its generation shard and the training rank each comes from:
each rollout rank receives exactly its generation shard, once (it holds no training copy, so
nothing is local), and the rollout's data-parallel replicas draw on different training
replicas, which spreads the sending. The plan is pure, so both sides compute it alike without
talking; :class:`ShardSender` and :class:`ShardReceiver` move the bytes bucket by bucket, in the
receiver's dtype (a bf16 rollout receives bf16). With ``delta`` (``parallel.rollout.weight_sync``),
every sync after the first sends each message as a delta against the previous one
(megarl.hybrid.delta): the sender keeps what it last sent, the receiver applies in place.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid import delta as deltas
from megarl.hybrid.executor import SyncStats, _CODE_DTYPES, _DTYPE_CODES, _view, message_tag, pack
from megarl.hybrid.names import check_planned, planned_tensors
from megarl.hybrid.planner import Segment, bucket_segments, replica, training_slices
from megarl.hybrid.shards import LocalTensor, ModelSpec, Placement
from megarl.models import lora
from megarl.parallel.layout import Layout
from megarl.runtime import cpu_mode
from megarl.runtime.devices import compute_device, synchronize
from megarl.runtime.distributed import bound_store, collective_timeout

@dataclass
class TransferPlan:
    """Every transfer of one split-placement sync (see the module docstring for rank numbers)."""

    model: ModelSpec
    train: Layout  # over the trainer's ranks
    gen: Layout  # over the rollout's ranks (position v = rollout world rank v)
    sources: Dict[int, List[LocalTensor]]  # training rank -> its training tensors
    shards: Dict[int, List[LocalTensor]]  # rollout rank -> its generation shard
    buckets: List[List[Segment]]  # src: training rank, dst: offset + rollout rank
    # tensors that never change after the first sync (a LoRA actor's frozen base): sent once
    static: FrozenSet[int] = frozenset()
    delta: bool = False  # after the first sync, messages go as deltas (megarl.hybrid.delta)

    @property
    def offset(self) -> int:
        return self.train.world_size

    @property
    def world_size(self) -> int:
        return self.train.world_size + self.gen.world_size

    def elems(self, seg: Segment) -> int:
        return self.model.tensors[seg.tensor].slice_numel(seg.stop - seg.start)

    def received(self, rollout_rank: int) -> int:
        """Elements rollout rank ``rollout_rank`` receives per sync."""
        dst = self.offset + rollout_rank
        return sum(self.elems(s) for b in self.buckets for s in b if s.dst == dst)

    def sent(self, train_rank: int) -> int:
        return sum(self.elems(s) for b in self.buckets for s in b if s.src == train_rank)

    def shard_elems(self, rollout_rank: int) -> int:
        return self.model.local_numel(self.shards[rollout_rank])


@functools.lru_cache(maxsize=8)
def plan_transfer(model: ModelSpec, train: Layout, gen: Layout, bucket_elems: int = 1 << 24,
                  static: FrozenSet[int] = frozenset(), delta: bool = False) -> TransferPlan:
    """Plan the sync from ``train`` (the actor's layout) to ``gen`` (the rollout's, pp = 1);
    ``static``: tensors (model indices) sent by the first sync only; ``delta``: later syncs send
    what changed (both sides read it from the plan)."""
    if gen.pp != 1:
        raise ValueError(f"the rollout layout {gen} has pipeline stages; split placement generates with pp=1")
    if bucket_elems < 1:
        raise ValueError(f"bucket size {bucket_elems} must be positive")
    train_at, gen_at = Placement(model, train), Placement(model, gen)
    segments: List[Segment] = []
    shards = {v: gen_at.local_tensors(v) for v in range(gen.world_size)}
    for v, targets in shards.items():
        reads = gen.coords(v)["dp"] % (train.dp * train.cp)  # the training replica (cp, dp) this one reads
        for target in targets:
            spec = model.tensors[target.spec]
            for lo, hi, j in training_slices(spec, target, train):
                holders = train_at.holders(spec, j)
                if not holders:
                    raise AssertionError(f"no training rank holds {spec.key}")
                same = [h for h in holders if replica(train, h) == reads] or holders
                # a range several ranks hold: chosen by the reader's tp rank, so every rollout
                # replica reads it from the same rank, which packs (and encodes) it once for all
                pick = same[gen.coords(v)["tp"] % len(same)]
                segments.append(Segment(target.spec, pick, train.world_size + v, lo, hi))
    return TransferPlan(model, train, gen, {r: train_at.local_tensors(r) for r in range(train.world_size)},
                        shards, bucket_segments(model, segments, bucket_elems), static, delta)


def connect(address: str, port: int, rank: int, world_size: int) -> dist.ProcessGroup:
    """The process group spanning trainer and rollout ranks (rank 0, a trainer rank, hosts the
    store). Collective over both groups: every member calls it at once. Gloo on CPU, NCCL on GPUs."""
    timeout = collective_timeout()  # this process's, as its own world's collectives
    store = bound_store(address, port, world_size, rank, timeout)
    prefixed = dist.PrefixStore("megarl/weights", store)
    if torch.cuda.is_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


class _Side:
    """What sender and receiver share: the plan, the spanning group, the agreed dtypes."""

    def __init__(self, plan: TransferPlan, rank: int):
        self.plan, self.rank = plan, rank  # rank in the spanning group
        self.group: Optional[dist.ProcessGroup] = None
        self.dtypes: List[torch.dtype] = []
        self.last = SyncStats()
        self.versions: Dict[int, int] = {}  # the colocated Resharder's interface (nothing to skip here)
        self.syncs = 0  # done so far: after the first, the plan's static tensors are skipped

    def _agree_dtypes(self, codes: torch.Tensor) -> None:
        """Rollout rank 0's dtype of every tensor, broadcast: the dtype each transfer uses."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.plan.offset, 0
        codes = codes.to(compute_device())  # the spanning group is NCCL wherever CUDA is (connect)
        self.group.broadcast([codes], opts).wait()
        self.dtypes = [_CODE_DTYPES.get(c, torch.float32) for c in codes.tolist()]

    def _moved(self) -> torch.Tensor:
        """Bool per model tensor: what the sync in progress moves (everything the first time)."""
        moved = torch.ones(len(self.plan.model.tensors), dtype=torch.bool)
        if self.syncs:
            moved[list(self.plan.static)] = False
        return moved

    def _pairs(self, bucket: List[Segment], mine) -> Dict[Tuple[int, int], List[Segment]]:
        """This rank's segments of ``bucket`` that this sync moves, by (peer, dtype)."""
        out: Dict[Tuple[int, int], List[Segment]] = {}
        for seg in bucket:
            if self.syncs and seg.tensor in self.plan.static:
                continue
            peer = mine(seg)
            if peer is not None:
                out.setdefault((peer, _DTYPE_CODES[self.dtypes[seg.tensor]]), []).append(seg)
        return out


class ShardSender(_Side):
    """A training rank's side: packs the ranges each rollout rank needs from its training tensors."""

    def __init__(self, plan: TransferPlan, rank: int, train_chunks: List[torch.nn.Module]):
        super().__init__(plan, rank)
        self.train_chunks = list(train_chunks)
        named = [planned_tensors(c) for c in train_chunks]
        check_planned(train_chunks, plan.sources[rank], f"training rank {rank}")
        self.train: Dict[int, Tuple[LocalTensor, torch.Tensor]] = {}
        self.fillers = {}  # merged LoRA weights: computed as the sync reads them
        for local in plan.sources[rank]:
            tensor = named[local.chunk].get(local.name)
            if tensor is None or tuple(tensor.shape) != local.shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"training rank {rank}: tensor '{local.name}' (chunk {local.chunk}) is {got}, "
                                 f"the transfer plan expects {local.shape} in layout {plan.train}")
            self.train[local.spec] = (local, tensor.detach())
            self.device = tensor.device
            fill = lora.filler(tensor)
            if fill:
                self.fillers[local.spec] = fill
        self.sent = deltas.LastSent()  # what each rollout rank holds of this rank's messages (delta)

    def connect(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._agree_dtypes(torch.zeros(len(self.plan.model.tensors), dtype=torch.int32))

    @torch.no_grad()
    def sync(self) -> SyncStats:
        """Send this rank's share of one sync; returns once the last bucket is on its way out
        and the one before is delivered (at most two buckets of buffers live). A LoRA model's
        adapted weights go merged (W + (alpha/r) B A)."""
        with lora.merged_for_sync(self.train_chunks), cpu_mode.suspended():  # names no CUDA device
            return self._sync()

    def _sync(self) -> SyncStats:
        begin, stats = time.perf_counter(), SyncStats()
        model, in_flight = self.plan.model, []
        nbytes = lambda bufs: sum(b.numel() * b.element_size() for b in bufs)  # noqa: E731
        for index, bucket in enumerate(self.plan.buckets):
            works, bufs, scratch, packed, payloads = [], [], 0, {}, []
            for (dst, code), segs in self._pairs(bucket, lambda s: s.dst if s.src == self.rank else None).items():
                key = (index, code, tuple((s.tensor, s.start, s.stop) for s in segs))
                if key not in packed:  # the same ranges to several rollout replicas: packed (and encoded) once
                    dtype = _CODE_DTYPES[code]
                    buf, merged = pack(self.train, self.fillers, model, segs, dtype, self.device)
                    scratch = max(scratch, merged)
                    if self.plan.delta:
                        message = self.sent.encode(key, buf)
                        scratch = max(scratch, message.transient_bytes)
                        bufs += [message.header, message.payload]
                    else:
                        message = buf
                        bufs.append(buf)
                    packed[key] = message
                message = packed[key]
                if self.plan.delta:  # every header of the bucket before its payloads, as the receiver posts
                    works.append(self.group.send([message.header], dst, message_tag(index, code, header=True)))
                    stats.elements_changed += message.nnz
                    message = message.payload
                payloads.append((message, dst, code))
            for message, dst, code in payloads:  # in the receiver's order per peer: NCCL ignores tags
                works.append(self.group.send([message], dst, message_tag(index, code)))
                stats.bytes_sent += message.numel() * message.element_size()
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, nbytes(bufs) + scratch
                                         + sum(nbytes(bs) for _, bs in in_flight))
            in_flight.append((works, bufs))
            if len(in_flight) > 1:
                for work in in_flight.pop(0)[0]:
                    work.wait()
        for works, _ in in_flight:
            for work in works:
                work.wait()
        moved = self._moved()
        stats.tensors_moved = sum(int(moved[spec]) for spec in self.train)
        self.sent.end_sync()
        stats.delta_copy_bytes = self.sent.nbytes
        self.syncs += 1
        synchronize()  # the copies are queued on the device
        stats.seconds = time.perf_counter() - begin
        self.last = stats
        return stats


class ShardReceiver(_Side):
    """A rollout rank's side: receives its generation shard into ``outputs`` (local name ->
    tensor, e.g. the generation model's parameters, filled in place)."""

    def __init__(self, plan: TransferPlan, rollout_rank: int, outputs: Dict[str, torch.Tensor]):
        super().__init__(plan, plan.offset + rollout_rank)
        self.shard = {t.spec: t for t in plan.shards[rollout_rank]}
        self.outputs = dict(outputs)
        for t in self.shard.values():
            out = self.outputs.get(t.name)
            if out is None or tuple(out.shape) != t.shape:
                got = None if out is None else tuple(out.shape)
                raise ValueError(f"rollout rank {rollout_rank}: generation tensor '{t.name}' is {got}, the "
                                 f"transfer plan expects {t.shape} in layout {plan.gen}")

    def connect(self, group: dist.ProcessGroup) -> None:
        self.group = group
        codes = torch.zeros(len(self.plan.model.tensors), dtype=torch.int32)
        for spec, t in self.shard.items():
            codes[spec] = _DTYPE_CODES[self.outputs[t.name].dtype]
        self._agree_dtypes(codes)

    @torch.no_grad()
    def sync(self) -> Dict[str, torch.Tensor]:
        """Receive one sync into the outputs (which it returns); the two newest buckets are in flight."""
        if self.group is None:
            raise RuntimeError("the rollout is not connected to the trainer's ranks (connect() first)")
        with cpu_mode.suspended():  # names no CUDA device
            return self._sync()

    def _sync(self) -> Dict[str, torch.Tensor]:
        begin, stats = time.perf_counter(), SyncStats()
        model = self.plan.model
        device = next(iter(self.outputs.values())).device
        pending, live = [], []  # handles of the buckets in flight, and their bytes

        def dests(segs):
            for seg in segs:
                local = self.shard[seg.tensor]
                yield _view(self.outputs[local.name], model.tensors[seg.tensor], local, seg.start, seg.stop)

        def finish(handle) -> None:
            for work, buf, segs, message, dtype in handle:
                work.wait()
                deltas.apply(message, buf.view(torch.uint8), dtype, list(dests(segs)))
            live.pop(0)

        for index, bucket in enumerate(self.plan.buckets):
            pairs = self._pairs(bucket, lambda s: s.src if s.dst == self.rank else None)
            headers = {}
            if self.plan.delta:  # each message's size comes first
                works = []
                for (src, code) in pairs:
                    headers[src, code] = deltas.empty_header(device)
                    works.append(self.group.recv([headers[src, code]], src, message_tag(index, code, header=True)))
                for work in works:
                    work.wait()
            handle, nbytes = [], 0
            for (src, code), segs in pairs.items():
                dtype = _CODE_DTYPES[code]
                numel = sum(self.plan.elems(s) for s in segs)
                message = (deltas.Encoding.dense, numel, 0)
                if self.plan.delta:
                    message, size = deltas.read_header(headers[src, code], numel, dtype.itemsize)
                    buf = torch.empty(size, dtype=torch.uint8, device=device)
                    stats.elements_changed += message[1]
                    nbytes += size + (0 if message[0] == deltas.Encoding.dense else numel + message[1] * 16)
                else:
                    buf = torch.empty(numel, dtype=dtype, device=device)
                    nbytes += numel * dtype.itemsize
                stats.dense_received += numel * dtype.itemsize
                handle.append((self.group.recv([buf], src, message_tag(index, code)), buf, segs, message, dtype))
                stats.bytes_received += buf.numel() * buf.element_size()
            pending.append(handle)
            live.append(nbytes)
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, sum(live))
            if len(pending) > 1:
                finish(pending.pop(0))
        for handle in pending:
            finish(handle)
        stats.changed = self._moved()
        stats.tensors_moved = sum(int(stats.changed[spec]) for spec in self.shard)
        self.syncs += 1
        synchronize()  # the copies are queued on the device
        stats.seconds = time.perf_counter() - begin
        self.last = stats
        return self.outputs

    def shard_bytes(self) -> int:
        """Bytes of this rank's generation shard that the last sync was to move (what it must
        receive, no more): all of it the first time, then the tensors that are not static."""
        changed = self.last.changed
        return sum(self.outputs[t.name].numel() * self.outputs[t.name].element_size() for spec, t in self.shard.items()
                   if changed is None or changed[spec])
