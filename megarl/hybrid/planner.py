"""3D-HybridEngine planner (HybridFlow §5): regroup a training layout into a generation layout and
list which slice every rank receives from whom. Pure (no tensors) and cached per layout pair.

Inside one training model-parallel group of t·p ranks, the d_g = (t·p)/(t_g·p_g) ranks whose
shards make up one generation shard form a *micro-DP group* (see ``shared/DESIGN.md`` §3). In
``micro_dp`` mode each rank receives only the missing part of its generation shard, from the
members of its micro-DP group; ``full_gather`` (the common practice, kept as a baseline) has
every rank receive the whole model from its model-parallel group and slice afterwards.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

from megarl.hybrid.shards import LocalTensor, ModelSpec, Piece, Placement, TensorSpec
from megarl.parallel.layout import Layout, LayoutError

MODES = ("micro_dp", "full_gather")


class ReshardError(ValueError):
    """A training/generation layout pair that cannot be resharded; the message says what to use."""


def hybridflow_bytes(t: int, p: int, t_g: int, p_g: int, model_bytes: float) -> Dict[str, float]:
    """Per-rank figures of HybridFlow Table 2 for a dense model of ``model_bytes``."""
    return {
        "micro_dp_received": (t * p - t_g * p_g) / (t_g * p_g * t * p) * model_bytes,
        "micro_dp_peak": model_bytes / (t_g * p_g),
        "full_gather_received": (t * p - 1) / (t * p) * model_bytes,
        "full_gather_peak": model_bytes,
    }


@dataclass(frozen=True)
class Regrouping:
    """Training layout, generation layout, and where each rank sits in the generation layout.

    ``gen_rank[r]`` is rank r's position in the generation layout's Megatron order
    (tp-cp-ep-dp-pp); generation process groups are the Megatron groups of ``gen`` over those
    positions. Data-parallel positions follow global rank order: (slice within the micro-DP
    group, training replica (cp, dp), stage within the micro-DP group), fastest first. The
    generation layout has no context parallelism: training cp ranks become generation replicas.
    """

    train: Layout
    gen: Layout
    gen_rank: Tuple[int, ...]

    @property
    def micro_dp(self) -> int:
        return (self.train.tp * self.train.pp) // (self.gen.tp * self.gen.pp)

    def gen_coords(self, rank: int) -> Dict[str, int]:
        return self.gen.coords(self.gen_rank[rank])

    def micro_dp_group(self, rank: int) -> Tuple[int, ...]:
        """The ranks that end with the same generation shard as ``rank`` (itself included)."""
        key = self._micro_key(rank)
        return tuple(r for r in range(self.train.world_size) if self._micro_key(r) == key)

    def micro_dp_groups(self) -> List[Tuple[int, ...]]:
        return sorted({self.micro_dp_group(r) for r in range(self.train.world_size)})

    def _micro_key(self, rank: int) -> Tuple[int, int, int]:
        g = self.gen_coords(rank)
        return replica(self.train, rank), g["tp"], g["pp"]

    def gen_groups(self, kind: str) -> List[List[int]]:
        """Generation process groups of ``kind`` (see :meth:`Layout.group_ranks`) as global ranks."""
        real = {v: r for r, v in enumerate(self.gen_rank)}
        return [[real[v] for v in group] for group in self.gen.group_ranks(kind)]


def valid_gen_sizes(train: Layout) -> List[Tuple[int, int]]:
    return [(tg, pg) for pg in range(1, train.pp + 1) if train.pp % pg == 0
            for tg in range(1, train.tp + 1) if train.tp % tg == 0]


def replica(layout: Layout, rank: int) -> int:
    """Which copy of the weights ``rank`` holds: its (cp, dp) index, cp fastest (Megatron's
    order); context-parallel ranks split sequences, not weights, so they are replicas too."""
    c = layout.coords(rank)
    return c["cp"] + layout.cp * c["dp"]


@functools.lru_cache(maxsize=64)
def regroup(train: Layout, gen_tp: int, gen_pp: int = 1, gen_ep: int = 1, num_experts: int = 0) -> Regrouping:
    """The generation layout of ``train`` at (t_g, p_g, e_g) and each rank's place in it.

    Expert weights in the generation layout keep whole experts under expert parallelism
    (etp_g = 1 when e_g > 1), and are split like dense weights (etp_g = t_g) when e_g = 1.
    """
    t, p = train.tp, train.pp
    if gen_tp < 1 or gen_pp < 1 or t % gen_tp or p % gen_pp:
        pairs = ", ".join(f"(t_g={a}, p_g={b})" for a, b in valid_gen_sizes(train))
        raise ReshardError(f"rollout tp={gen_tp}, pp={gen_pp} cannot be regrouped from actor tp={t}, "
                           f"pp={p}: t_g must divide tp and p_g must divide pp; valid: {pairs}")
    if num_experts == 0 and gen_ep != 1:
        raise ReshardError(f"rollout ep={gen_ep} is set but the model has no experts; use ep=1")
    if num_experts and (gen_ep < 1 or num_experts % gen_ep):
        ok = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ReshardError(f"rollout ep={gen_ep} must divide num_experts={num_experts}; valid: {ok}")
    a, b = t // gen_tp, p // gen_pp
    replicas = train.dp * train.cp  # context-parallel ranks hold the same weights: cp folds into dp
    gen_dp = replicas * a * b
    gen = Layout(tp=gen_tp, pp=gen_pp, dp=gen_dp, ep=gen_ep, etp=1 if gen_ep > 1 else gen_tp,
                 sequence_parallel=train.sequence_parallel)
    try:
        gen.validate(train.world_size)
    except LayoutError as err:
        raise ReshardError(f"rollout layout {gen} is impossible: {err}") from None
    ranks = []
    for r in range(train.world_size):
        c = train.coords(r)
        dp = (c["tp"] % a) + a * replica(train, r) + a * replicas * (c["pp"] % b)
        ranks.append(c["tp"] // a + gen_tp * dp + gen_tp * gen_dp * (c["pp"] // b))
    return Regrouping(train, gen, tuple(ranks))


@dataclass(frozen=True)
class Segment:
    """Range [start, stop) of tensor ``tensor`` along its split dim, sent from ``src`` to ``dst``."""

    tensor: int
    src: int
    dst: int
    start: int
    stop: int


@dataclass
class ReshardPlan:
    """Everything every rank does in one weight sync (ranks agree on it without talking)."""

    model: ModelSpec
    regrouping: Regrouping
    mode: str
    sources: Dict[int, List[LocalTensor]]  # training tensors of each rank
    targets: Dict[int, List[LocalTensor]]  # what each rank assembles (the full model in full_gather)
    gen: Dict[int, List[LocalTensor]]  # each rank's generation shard
    local: Dict[int, List[Segment]]  # copies from a rank's own training tensors
    buckets: List[List[Segment]]  # transfers between ranks, bucket by bucket

    def received(self, rank: int) -> int:
        """Elements ``rank`` receives from other ranks."""
        return sum(self.elems(s) for b in self.buckets for s in b if s.dst == rank)

    def sent(self, rank: int) -> int:
        return sum(self.elems(s) for b in self.buckets for s in b if s.src == rank)

    def elems(self, seg: Segment) -> int:
        return self.model.tensors[seg.tensor].slice_numel(seg.stop - seg.start)


def _full_tensors(model: ModelSpec) -> List[LocalTensor]:
    return [LocalTensor(0, spec.key, i, spec.shape, (Piece(0, spec.shape[spec.split_dim], 0),))
            for i, spec in enumerate(model.tensors)]


def training_slices(spec: TensorSpec, target: LocalTensor, train: Layout) -> Iterator[Tuple[int, int, int]]:
    """(start, stop, j): the ranges of ``target``'s pieces that lie in tensor-parallel slice j of
    the training layout (fused blocks split per block), in order."""
    parts = 1 if spec.dim is None else (train.etp if spec.expert is not None else train.tp)
    bounds = spec.block_bounds()
    for piece in target.pieces:
        for start, size in bounds:
            width = size // parts
            for j in range(parts):
                lo = max(piece.start, start + j * width)
                hi = min(piece.stop, start + (j + 1) * width)
                if lo < hi:
                    yield lo, hi, j


class _Coverer:
    """Finds, for each range a rank must end with, the training ranks it comes from."""

    def __init__(self, model: ModelSpec, regrouping: Regrouping, mode: str):
        self.model, self.rg, self.mode = model, regrouping, mode
        self.train = Placement(model, regrouping.train)
        self.gen = Placement(model, regrouping.gen)

    def targets(self, rank: int) -> List[LocalTensor]:
        if self.mode == "full_gather":
            return _full_tensors(self.model)
        return self.gen.local_tensors(self.rg.gen_rank[rank])

    def near(self, rank: int) -> set:
        """Ranks a receiver prefers as sources: its micro-DP group (micro_dp), or its training
        model-parallel group (full_gather)."""
        if self.mode == "micro_dp":
            return set(self.rg.micro_dp_group(rank))
        mine = replica(self.rg.train, rank)
        return {r for r in range(self.rg.train.world_size) if replica(self.rg.train, r) == mine}

    def segments(self, rank: int) -> Iterator[Segment]:
        near = self.near(rank)
        dp = replica(self.rg.train, rank)
        for target in self.targets(rank):
            spec = self.model.tensors[target.spec]
            for lo, hi, j in training_slices(spec, target, self.rg.train):
                src = self._pick(rank, self.train.holders(spec, j), near, dp, spec)
                yield Segment(target.spec, src, rank, lo, hi)

    def _pick(self, rank: int, holders: List[int], near: set, dp: int, spec: TensorSpec) -> int:
        if not holders:
            raise AssertionError(f"no training rank holds {spec.key}")
        if rank in holders:
            return rank
        close = [h for h in holders if h in near]
        if close:
            return close[0]
        # Experts spread over data-parallel ranks: prefer the same training dp index, then any,
        # spreading receivers over the replicas.
        same_dp = [h for h in holders if replica(self.rg.train, h) == dp]
        pool = same_dp or holders
        return pool[rank % len(pool)]


def rank_traffic(model: ModelSpec, regrouping: Regrouping, rank: int, mode: str = "micro_dp",
                 gpus_per_node: int = 0) -> Dict[str, int]:
    """Elements ``rank`` receives and ends with, without planning the other ranks (cost models).
    With ``gpus_per_node``, received elements are split into same-node and other-node senders
    (ranks fill nodes in order)."""
    cov = _Coverer(model, regrouping, mode)
    received = inter = 0
    for seg in cov.segments(rank):
        if seg.src != rank:
            n = model.tensors[seg.tensor].slice_numel(seg.stop - seg.start)
            received += n
            if gpus_per_node and seg.src // gpus_per_node != rank // gpus_per_node:
                inter += n
    shard = model.local_numel(cov.gen.local_tensors(regrouping.gen_rank[rank]))
    held = model.local_numel(cov.train.local_tensors(rank))
    return {"received": received, "received_other_nodes": inter, "gen_shard": shard, "train_shard": held,
            "assembled": model.numel() if mode == "full_gather" else shard}


@functools.lru_cache(maxsize=16)
def plan_reshard(model: ModelSpec, regrouping: Regrouping, mode: str = "micro_dp",
                 bucket_elems: int = 1 << 24) -> ReshardPlan:
    """Plan one sync for every rank. A bucket moves at most ``bucket_elems`` elements into and
    out of any one rank (send plus receive buffers); larger ranges are cut along their dim."""
    if mode not in MODES:
        raise ValueError(f"reshard mode '{mode}' must be one of {MODES}")
    if bucket_elems < 1:
        raise ValueError(f"bucket size {bucket_elems} must be positive")
    cov = _Coverer(model, regrouping, mode)
    world = regrouping.train.world_size
    local: Dict[int, List[Segment]] = defaultdict(list)
    remote: List[Segment] = []
    for rank in range(world):
        for seg in cov.segments(rank):
            (local[rank] if seg.src == rank else remote).append(seg)
    buckets = bucket_segments(model, remote, bucket_elems)
    return ReshardPlan(
        model=model, regrouping=regrouping, mode=mode,
        sources={r: cov.train.local_tensors(r) for r in range(world)},
        targets={r: cov.targets(r) for r in range(world)},
        gen={r: cov.gen.local_tensors(regrouping.gen_rank[r]) for r in range(world)},
        local=dict(local), buckets=buckets)


def bucket_segments(model: ModelSpec, remote: List[Segment], bucket_elems: int) -> List[List[Segment]]:
    """Transfers in buckets that move at most ``bucket_elems`` elements into and out of any one
    rank (send plus receive buffers); larger ranges are cut along their dim. The copies of one
    range to several ranks (rollout replicas, the members of a micro-DP group) share a bucket, so
    that a sender whose messages to them are alike packs (and delta-encodes) them once. Each copy
    counts on its sender as if packed apart (its messages to the others may differ)."""
    remote = sorted(remote, key=lambda s: (s.tensor, s.start, s.stop, s.dst))
    buckets: List[List[Segment]] = [[]]
    load: Dict[int, int] = defaultdict(int)
    for (tensor, lo, hi), copies in itertools.groupby(remote, key=lambda s: (s.tensor, s.start, s.stop)):
        copies = list(copies)
        row = model.tensors[tensor].slice_numel(1)
        step = max(1, bucket_elems // 2 // len(copies) // row)  # every end of the copies fits in one bucket
        for start in range(lo, hi, step):
            pieces = [Segment(c.tensor, c.src, c.dst, start, min(hi, start + step)) for c in copies]
            size = row * (pieces[0].stop - pieces[0].start)
            adds: Dict[int, int] = defaultdict(int)
            for piece in pieces:
                adds[piece.src] += size
                adds[piece.dst] += size
            if buckets[-1] and any(load[rank] + n > bucket_elems for rank, n in adds.items()):
                buckets.append([])
                load.clear()
            buckets[-1].extend(pieces)
            for rank, n in adds.items():
                load[rank] += n
    return [b for b in buckets if b]
