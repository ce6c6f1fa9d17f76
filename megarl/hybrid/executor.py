"""3D-HybridEngine executor: performs a :class:`ReshardPlan` on this rank.

Bucket by bucket, each rank packs the ranges others need from its training tensors into flat
send buffers, receives its missing ranges into flat receive buffers, and copies them into its
generation-layout tensors (this copy is the re-layout: a generation shard of a fused gate/up
weight is [gate; up] again). With ``overlap`` the next bucket is in flight while the previous
one is copied out, and buckets are planned at half the memory budget so that the in-flight
buffers never exceed it. Frozen weights (``requires_grad=False``) move once and again only if
their version counter changes: optimizers write through ``.data``, which version counters do not
see, so trainable weights always move. Messages travel in the generation tensors' dtype (a bf16
rollout of fp32 training moves bf16: the cast happens before the send, the same rounding as after).
With ``delta`` (``parallel.rollout.weight_sync=delta``) every message after the first goes as the
change since the last one (megarl.hybrid.delta), applied to the generation tensors in place: the
engine must keep them between syncs (the native engine parks them on the host while the trainer runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid import delta as deltas
from megarl.hybrid.names import check_planned, planned_tensors
from megarl.hybrid.planner import ReshardPlan, Regrouping, Segment, plan_reshard
from megarl.hybrid.shards import LocalTensor, ModelSpec, TensorSpec
from megarl.models import lora
from megarl.runtime import cpu_mode, progress
from megarl.runtime.devices import group_device, synchronize

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclass
class SyncStats:
    """What one sync did on this rank (bytes counted where they enter the transport)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    dense_received: int = 0  # what bytes_received would be in a full sync (delta: the fraction's base)
    elements_changed: int = 0  # delta: elements sent or received as changed (dense messages: all)
    delta_copy_bytes: int = 0  # delta: the sender's copy of what it last sent (kept between syncs)
    peak_extra_bytes: int = 0  # live send/receive buffers and temporaries (plus the full model in full_gather)
    tensors_moved: int = 0
    tensors_skipped: int = 0
    seconds: float = 0.0
    engine_bytes: int = 0  # handed on to an external engine (vLLM) after the reshard
    changed: Optional[torch.Tensor] = None  # bool per model tensor: what this sync moved (None: unknown)


def message_tag(bucket: int, code: int, header: bool = False) -> int:
    """The tag of a bucket's message of dtype ``code`` (its delta header: ``header``)."""
    return bucket * 16 + (8 if header else 0) + code


def pack(train, fillers, model: ModelSpec, segs: List[Segment], dtype: torch.dtype, device) -> Tuple[torch.Tensor, int]:
    """The segments' ranges of this rank's training tensors, cast straight into one flat buffer of
    ``dtype``, and the bytes of the largest merged LoRA weight computed for them (``fillers``:
    lora.filler of each such tensor; each computed just before its range is read)."""
    buf = torch.empty(sum(model.tensors[s.tensor].slice_numel(s.stop - s.start) for s in segs), dtype=dtype,
                      device=device)
    offset = merged = 0
    for seg in segs:
        local, tensor = train[seg.tensor]
        fill = fillers.get(seg.tensor)
        merged = max(merged, fill() if fill else 0)
        part = _view(tensor, model.tensors[seg.tensor], local, seg.start, seg.stop)
        buf[offset:offset + part.numel()].view(part.shape).copy_(part)
        offset += part.numel()
    return buf, merged


class P2PTransport:
    """torch.distributed point-to-point (gloo or NCCL): one message per peer and bucket."""

    def start(self, sends: Dict[Tuple[int, int], torch.Tensor], recvs: Dict[Tuple[int, int], torch.Tensor]):
        """Post receives and sends, keyed by (peer, tag); returns what :meth:`wait` takes."""
        ops = [dist.P2POp(dist.irecv, buf, src, tag=tag) for (src, tag), buf in sorted(recvs.items())]
        ops += [dist.P2POp(dist.isend, buf, dst, tag=tag) for (dst, tag), buf in sorted(sends.items())]
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works) -> None:
        for work in works:
            work.wait()


def _view(tensor: torch.Tensor, spec: TensorSpec, local: LocalTensor, start: int, stop: int) -> torch.Tensor:
    """The part of a local tensor that holds global range [start, stop) along the split dim."""
    for piece in local.pieces:
        if piece.start <= start and stop <= piece.stop:
            return tensor.narrow(spec.split_dim, piece.local_start + start - piece.start, stop - start)
    raise AssertionError(f"{local.name} holds no range [{start}, {stop}) of {spec.key}")


class Resharder:
    """Moves the actor's training shards into generation-layout tensors on this rank.

    ``train_chunks`` are this rank's training model chunks; :meth:`sync` fills (and keeps) one
    tensor per generation-layout local name. ``outputs`` may pass tensors to fill in place,
    e.g. a generation model's parameters (the in-process transport of the native rollout).
    """

    @classmethod
    def create(cls, model: ModelSpec, regrouping: Regrouping, train_chunks: List[torch.nn.Module],
               bucket_bytes: int = 256 << 20, mode: str = "micro_dp", overlap: bool = True,
               outputs: Optional[Dict[str, torch.Tensor]] = None, delta: bool = False,
               out_dtype: Optional[torch.dtype] = None) -> "Resharder":
        """Plan (cached) and prepare a sync whose extra buffers stay within ``bucket_bytes``;
        ``out_dtype``: the dtype of the generation tensors it allocates (default: training's)."""
        itemsize = next(p for c in train_chunks for p in c.parameters()).element_size()
        elems = max(1, bucket_bytes // itemsize // (2 if overlap else 1))
        return cls(plan_reshard(model, regrouping, mode, elems), train_chunks, outputs, overlap, delta=delta,
                   out_dtype=out_dtype)

    def __init__(self, plan: ReshardPlan, train_chunks: List[torch.nn.Module],
                 outputs: Optional[Dict[str, torch.Tensor]] = None, overlap: bool = True,
                 transport: Optional[P2PTransport] = None, delta: bool = False,
                 out_dtype: Optional[torch.dtype] = None):
        if delta and plan.mode == "full_gather":
            raise ValueError("weight_sync=delta needs the micro_dp resharding (full_gather rebuilds the model "
                             "every sync: nothing to apply a delta to)")
        self.plan, self.overlap, self.delta = plan, overlap, delta
        self.train_chunks = list(train_chunks)
        self.rank = dist.get_rank()
        self.transport = transport or P2PTransport()
        named = [planned_tensors(c) for c in train_chunks]
        check_planned(train_chunks, plan.sources[self.rank], f"rank {self.rank}")
        self.train: Dict[int, Tuple[LocalTensor, torch.Tensor]] = {}
        self.originals: Dict[int, torch.Tensor] = {}  # the parameters themselves (requires_grad)
        for local in plan.sources[self.rank]:
            tensor = named[local.chunk].get(local.name)
            if tensor is None or tuple(tensor.shape) != local.shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"rank {self.rank}: training tensor '{local.name}' (chunk {local.chunk}) "
                                 f"is {got}, the plan expects {local.shape}; the model does not "
                                 f"match the layout {plan.regrouping.train}")
            self.train[local.spec] = (local, tensor.detach())
            self.originals[local.spec] = tensor
        self.fillers = {spec: f for spec, f in ((s, lora.filler(t)) for s, t in self.originals.items()) if f}
        some = next(iter(self.train.values()))[1]
        # Ranks agree on each tensor's dtype (a receiver may hold no training copy of it).
        codes = torch.zeros(len(plan.model.tensors), dtype=torch.int32)
        for spec, (_, tensor) in self.train.items():
            codes[spec] = _DTYPE_CODES[tensor.dtype]
        codes = codes.to(group_device())
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        self.dtypes = [_CODE_DTYPES[c] for c in codes.tolist()]
        # Ranks agree on which tensors are frozen (moved only when their version changes).
        frozen = torch.zeros(len(plan.model.tensors), dtype=torch.int32)
        for spec, tensor in self.originals.items():
            frozen[spec] = int(isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad
                               and spec not in self.fillers)  # a merged LoRA weight moves every sync
        frozen = frozen.to(group_device())
        dist.all_reduce(frozen, op=dist.ReduceOp.MAX)
        self.frozen = [bool(f) for f in frozen.tolist()]
        self.device = some.device
        self.outputs = dict(outputs or {})
        self.gen = {t.spec: t for t in plan.gen[self.rank]}
        self.targets = {t.spec: t for t in plan.targets[self.rank]}
        # the generation tensors this executor allocates itself: :meth:`release` may free them
        self.owned = [t.name for t in plan.gen[self.rank] if t.name not in self.outputs]
        self.released = False
        self.parked: Dict[str, torch.Tensor] = {}  # generation tensors waiting on the host (release)
        for t in plan.gen[self.rank]:
            out = self.outputs.get(t.name)
            if out is None:
                self.outputs[t.name] = torch.empty(t.shape, dtype=out_dtype or self.dtypes[t.spec], device=self.device)
            elif tuple(out.shape) != t.shape:
                raise ValueError(f"rank {self.rank}: generation tensor '{t.name}' is {tuple(out.shape)}, "
                                 f"the plan expects {t.shape} in layout {plan.regrouping.gen}")
        self.wire = self._wire_dtypes()
        # the tensors it allocates take memory from the first sync on, not before: a colocated
        # engine starts after this (with the trainer offloaded), and must find the device free
        for name in self.owned:
            self.outputs[name].untyped_storage().resize_(0)
        self.released = bool(self.owned)
        self.versions: Dict[int, int] = {}
        self.sent = deltas.LastSent()  # delta: what the peers hold of this rank's messages
        self.last = SyncStats()

    def _wire_dtypes(self) -> List[torch.dtype]:
        """Each tensor's message dtype: its generation tensors' (all ranks agree), training's in
        full_gather (the gathered model is in training's)."""
        if self.plan.mode == "full_gather":
            return list(self.dtypes)
        codes = torch.zeros(len(self.plan.model.tensors), dtype=torch.int32)
        for spec, t in self.gen.items():
            codes[spec] = _DTYPE_CODES[self.outputs[t.name].dtype]
        codes = codes.to(group_device())
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        return [_CODE_DTYPES.get(c, d) for c, d in zip(codes.tolist(), self.dtypes)]

    def release(self) -> None:
        """Free the generation tensors this executor allocated itself, once an engine holds a copy
        (colocated vLLM and SGLang): kept, they stay on the device through training, 1/t_g of the
        model. The next sync grows them back. What it will not move waits on the host meanwhile:
        frozen weights (copied once, again only after a sync moved them), so that they still move
        only when their version changes; with ``delta`` every value (the next changes apply to them)."""
        if self.released or not self.owned:
            return
        moved = self.last.changed
        for t in self.plan.gen[self.rank]:
            if t.name not in self.owned or not (self.delta or self.frozen[t.spec]):
                continue
            if t.name not in self.parked or moved is None or bool(moved[t.spec]):
                self.parked[t.name] = self.outputs[t.name].to("cpu", copy=True)
        for name in self.owned:
            self.outputs[name].untyped_storage().resize_(0)
        self.released = True

    def _regrow(self) -> None:
        for name in self.owned:
            out = self.outputs[name]
            out.untyped_storage().resize_(out.numel() * out.element_size())
            if name in self.parked:
                out.copy_(self.parked[name])
        if self.delta:
            self.parked.clear()  # every value moves back: the host copy is not kept
        self.released = False

    # -- which tensors moved since the last sync: every rank must agree, so flags are all-reduced
    def _changed(self, force: bool) -> torch.Tensor:
        flags = torch.zeros(len(self.plan.model.tensors), dtype=torch.int32)
        for spec, (_, tensor) in self.train.items():
            frozen = isinstance(self.originals[spec], torch.nn.Parameter) and not self.originals[spec].requires_grad
            if force or not frozen or self.versions.get(spec) != tensor._version:
                flags[spec] = 1
        flags = flags.to(group_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags.bool().cpu()  # indexed by the host-side loop over tensors

    def _target(self, spec: int, full: Dict[int, torch.Tensor]) -> Tuple[LocalTensor, torch.Tensor]:
        if self.plan.mode == "full_gather":
            return self.targets[spec], full[spec]
        local = self.gen[spec]
        return local, self.outputs[local.name]

    @torch.no_grad()
    def sync(self, force: bool = False) -> Dict[str, torch.Tensor]:
        """One weight sync (collective over the world); returns the generation-layout tensors.
        ``force`` moves frozen weights too (after editing them through ``.data``). A LoRA model's
        adapted weights move merged (W + (alpha/r) B A, filled for the sync), its frozen rest once."""
        with lora.merged_for_sync(self.train_chunks), cpu_mode.suspended():  # names no CUDA device
            return self._sync(force)

    def _sync(self, force: bool) -> Dict[str, torch.Tensor]:
        begin = time.perf_counter()
        if self.released:
            self._regrow()
        stats = SyncStats()
        changed = self._changed(force)
        model = self.plan.model
        live = 0
        full: Dict[int, torch.Tensor] = {}
        if self.plan.mode == "full_gather":  # the baseline holds the whole model at once
            for spec, t in self.targets.items():
                if changed[spec]:
                    full[spec] = torch.empty(t.shape, dtype=self.dtypes[spec], device=self.device)
                    live += full[spec].numel() * full[spec].element_size()
            stats.peak_extra_bytes = live

        nbytes = lambda bufs: sum(b.numel() * b.element_size() for b in bufs)  # noqa: E731

        def dests(segs):
            for seg in segs:
                local, out = self._target(seg.tensor, full)
                yield _view(out, model.tensors[seg.tensor], local, seg.start, seg.stop)

        def start(index: int, bucket: List[Segment]):
            nonlocal live
            # One message per (peer, dtype); tags keep messages of overlapping buckets apart.
            sends: Dict[Tuple[int, int], List[Segment]] = {}
            recvs: Dict[Tuple[int, int], List[Segment]] = {}
            for seg in bucket:
                if not changed[seg.tensor]:
                    continue
                code = _DTYPE_CODES[self.wire[seg.tensor]]
                if seg.src == self.rank:
                    sends.setdefault((seg.dst, code), []).append(seg)
                if seg.dst == self.rank:
                    recvs.setdefault((seg.src, code), []).append(seg)
            packed: Dict[tuple, object] = {}
            held: List[torch.Tensor] = []  # this bucket's buffers, live until finish()
            send_bufs, header_sends, scratch = {}, {}, 0
            for (dst, code), segs in sends.items():
                key = tuple((s.tensor, s.start, s.stop) for s in segs)
                if key not in packed:  # the same ranges to several peers share one buffer
                    wire = _CODE_DTYPES[code]
                    buf, merged = pack(self.train, self.fillers, model, segs, wire, self.device)
                    scratch = max(scratch, merged)
                    if self.delta:
                        message = self.sent.encode(key, buf)
                        scratch = max(scratch, message.transient_bytes)
                        stats.elements_changed += message.nnz
                        packed[key] = message
                        held += [message.header, message.payload]
                    else:
                        packed[key] = buf
                        held.append(buf)
                message = packed[key]
                if self.delta:
                    header_sends[dst, message_tag(index, code, header=True)] = message.header
                    send_bufs[dst, message_tag(index, code)] = message.payload
                else:
                    send_bufs[dst, message_tag(index, code)] = message
            headers = {}
            if self.delta:  # each message's size comes first
                headers = {(src, message_tag(index, code, header=True)): deltas.empty_header(self.device)
                           for src, code in recvs}
                self.transport.wait(self.transport.start(header_sends, headers))
            recv_bufs, decode = {}, {}
            for (src, code), segs in recvs.items():
                wire, numel = _CODE_DTYPES[code], sum(self.plan.elems(s) for s in segs)
                if self.delta:
                    message, size = deltas.read_header(headers[src, message_tag(index, code, header=True)],
                                                       numel, wire.itemsize)
                    recv_bufs[src, message_tag(index, code)] = torch.empty(size, dtype=torch.uint8, device=self.device)
                    decode[src, code] = message
                    stats.elements_changed += message[1]
                    if message[0] != deltas.Encoding.dense:  # positions (and a mask) while applied
                        scratch = max(scratch, numel + message[1] * 16)
                else:
                    recv_bufs[src, message_tag(index, code)] = torch.empty(numel, dtype=wire, device=self.device)
                stats.dense_received += numel * wire.itemsize
            held += list(recv_bufs.values())
            live += nbytes(held)
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, live + scratch)
            stats.bytes_sent += nbytes(send_bufs.values())
            stats.bytes_received += nbytes(recv_bufs.values())
            works = self.transport.start(send_bufs, recv_bufs)
            return works, index, recvs, recv_bufs, decode, held

        def finish(handle) -> None:
            nonlocal live
            works, index, recvs, recv_bufs, decode, held = handle
            self.transport.wait(works)
            for (src, code), segs in recvs.items():
                message = decode.get((src, code), (deltas.Encoding.dense, 0, 0))
                deltas.apply(message, recv_bufs[src, message_tag(index, code)].view(torch.uint8), _CODE_DTYPES[code],
                             list(dests(segs)))
            live -= nbytes(held)

        buckets = self.plan.buckets
        pending = start(0, buckets[0]) if buckets else None
        for seg in self.plan.local.get(self.rank, []):  # own ranges, while bucket 0 is in flight
            if changed[seg.tensor]:
                merged = self.fillers[seg.tensor]() if seg.tensor in self.fillers else 0
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, live + merged)
                spec = model.tensors[seg.tensor]
                local, out = self._target(seg.tensor, full)
                src_local, src = self.train[seg.tensor]
                _view(out, spec, local, seg.start, seg.stop).copy_(_view(src, spec, src_local, seg.start, seg.stop))
        for index in range(1, len(buckets)):
            progress.tick()  # a bucket: what the driver's hang check sees advance
            if self.overlap:
                nxt = start(index, buckets[index])
                finish(pending)
                pending = nxt
            else:
                finish(pending)
                pending = start(index, buckets[index])
        if pending is not None:
            finish(pending)
        if self.plan.mode == "full_gather":  # slice the generation shard out of the full model
            for spec, local in self.gen.items():
                if changed[spec]:
                    out = self.outputs[local.name]
                    for piece in local.pieces:
                        out.narrow(model.tensors[spec].split_dim, piece.local_start, piece.stop - piece.start).copy_(
                            full[spec].narrow(model.tensors[spec].split_dim, piece.start, piece.stop - piece.start))
            full.clear()
        for spec, (_, tensor) in self.train.items():
            self.versions[spec] = tensor._version
        self.sent.end_sync()
        stats.delta_copy_bytes = self.sent.nbytes
        stats.tensors_moved = int(changed.sum())
        stats.tensors_skipped = len(changed) - stats.tensors_moved
        stats.changed = changed
        synchronize()  # the copies are queued on the device
        stats.seconds = time.perf_counter() - begin
        self.last = stats
        return self.outputs
