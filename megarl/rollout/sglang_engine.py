"""SGLang rollout for GPU clusters (optional extra ``sglang``), fed by the 3D-HybridEngine.

One SGLang engine per generation replica, started from the replica's generation-TP rank 0 on
the replica's GPUs with dummy weights and the memory saver. A weight update takes the hybrid
engine's generation shards, joins them over the generation TP group (SGLang's loaders take
whole Hugging Face tensors and shard them themselves), renames them with the HF mapping tables,
and hands them over bucket by bucket as CUDA-IPC handles, one payload per TP rank, through
``update_weights_from_tensor``: no host copy. Split placement uses ``init_weights_update_group``
and ``update_weights_from_distributed`` instead.

Devices: each engine spans the GPUs of its replica's t_g generation-TP ranks, SGLang's TP rank i on
rank i's GPU (where rank i's CUDA-IPC payloads live). A Ray worker sees only its own GPU, so the
engine's processes start with ``CUDA_VISIBLE_DEVICES`` set to the node ids of those t_g GPUs and
``base_gpu_id=0`` (:func:`engine_devices`), as verl does for its colocated SGLang engines.

Memory (colocated): SGLang's memory saver releases its weights, KV cache and CUDA graphs while
the trainer holds the device, and takes them back in two steps: the weights before the sync, the
KV cache and CUDA graphs only once the trainer has offloaded its states (``resume_kv_cache``), so
that the trainer's states and SGLang's KV cache are never resident together.

Split placement: trainer and rollout agree on the weights, bucket by bucket, without talking:
both derive the list from the model alone (:func:`hf_bucket_plan`). The trainer's
:class:`SGLangBroadcaster` gathers each bucket's whole tensors on its rank 0 and broadcasts them
over a process group that spans it and SGLang's TP workers (:func:`weights_process_group` on the
trainer, ``init_weights_update_group`` in SGLang); :meth:`SGLangRollout.receive_weights` posts
the matching receives (``update_weights_from_distributed``).

The parts that need no GPU (names, buckets, payload layout, bucket plan, gathering, the process
group, devices) are plain functions and classes, tested on CPU. Pinned: SGLang 0.5.6.post2 (the
Dockerfile's base image); setup.py's extra asks for sglang>=0.5.0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid.executor import SyncStats
from megarl.hybrid.names import check_planned, planned_tensors
from megarl.hybrid.shards import LocalTensor, ModelSpec, Placement, TensorSpec
from megarl.models.hf_config import MegatronModelArgs
from megarl.models.hf_mapping import build_plan
from megarl.parallel import Layout
from megarl.rollout.types import Response, RolloutEngine, RolloutStats, SamplingParams

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


# ----------------------------------------------------------------------------- split placement: the weights


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


# ----------------------------------------------------------------------------- devices and versions


def physical_device(visible: Optional[str], index: int) -> str:
    """The node's id of this process's CUDA device ``index``: its entry in ``visible`` (the
    process's CUDA_VISIBLE_DEVICES; Ray sets it to the worker's own GPUs), or ``index`` when unset."""
    if visible is None:
        return str(index)
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    if index >= len(ids):
        raise ValueError(f"CUDA device {index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[index]


def check_engine_devices(ranks: Sequence[Tuple[str, str]]) -> List[str]:
    """(host, node device id) of each generation-TP rank, TP rank order → the devices one SGLang
    engine spans. Raises ValueError when the ranks are on several hosts or share a GPU."""
    hosts = sorted({host for host, _ in ranks})
    if len(hosts) > 1:
        raise ValueError(f"a generation TP group spans hosts {hosts}; SGLang's engine runs on one node: "
                         f"keep parallel.rollout.tp within trainer.nproc_per_node")
    ids = [device for _, device in ranks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"generation TP ranks share GPUs {ids}; SGLang's TP workers need one GPU each")
    return ids


def engine_devices(tp_group) -> List[str]:
    """The node's ids of the GPUs of the generation TP group's ranks, TP rank order (collective over
    the group)."""
    mine = (socket.gethostname(), physical_device(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device()))
    ranks: list = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(ranks, mine, group=tp_group)
    return check_engine_devices(ranks)


@contextlib.contextmanager
def visible_devices(ids: Sequence[str]) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=ids`` for the processes started inside (SGLang's schedulers inherit it
    at spawn and take device ``base_gpu_id + tp_rank``); this process's CUDA context keeps its own."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def worker_env() -> Dict[str, str]:
    """Environment of every worker of an SGLang run. SGLang's engine sets NCCL_CUMEM_ENABLE=0 in its
    processes unless it is set already (``_set_envs_and_config``); the trainer's ranks, which share
    the split placement's weights group with SGLang's workers, take the same value (NCCL reads it once
    per process, before its first communicator)."""
    return {"NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE", "0")}


# SGLang versions whose ``init_weights_update_group`` was read: each TP worker joins the group
# through ``init_custom_process_group`` (a tcp:// rendezvous, ``PrefixStore(group_name)``, no
# ``device_id``: NCCL's communicator is made at the first broadcast) and returns, with no collective
# over the group; :func:`weights_process_group` does the same on the trainer's side.
RENDEZVOUS_CHECKED = ((0, 5, 6), (0, 5, 23))


def release_tuple(version: str) -> Tuple[int, ...]:
    """``0.5.6.post2`` → (0, 5, 6): the release, without post/dev/rc tags."""
    return tuple(int(m) for m in re.findall(r"\d+", version.split("+")[0])[:3])


def rendezvous_warning(version: str) -> Optional[str]:
    """Why the split placement's weights group may not meet SGLang ``version``'s, or None."""
    low, high = RENDEZVOUS_CHECKED
    if low <= release_tuple(version) <= high:
        return None
    return (f"SGLang {version}: the weights group's rendezvous was checked against SGLang "
            f"{'.'.join(map(str, low))}..{'.'.join(map(str, high))} (lazy NCCL init, no barrier); if this "
            f"version's init_weights_update_group adds a collective, the trainer's rank 0 must join it")


# ----------------------------------------------------------------------------- the engine (GPU)


def request_params(rows: Sequence[Tuple[int, int]], sampling: SamplingParams) -> List[dict]:
    """SGLang sampling parameters of each (prompt, sample) row. With a seed, each row gets its own
    (SGLang seeds each request alone; the samples of a prompt must differ)."""
    base = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
            "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids)}
    if sampling.seed is None and sampling.prompt_seeds is None:
        return [dict(base) for _ in rows]
    keys = [(sampling.stream_key(sampling.seed or 0, p), s) for p, s in rows]
    return [base | {"sampling_seed": (seed * 1_000_003 + p * 7_919 + s) % (1 << 31)} for (seed, p), s in keys]


# SGLang's memory-saver tags (sglang/srt/constants.py): released together, resumed in two steps
WEIGHTS, GENERATION = ("weights",), ("kv_cache", "cuda_graph")
WEIGHTS_GROUP = "megarl-weights"  # split placement: the trainer's rank 0 and SGLang's workers


def write_hf_dir(hf_config: dict, dtype: torch.dtype, tokenizer: Optional[str] = None) -> str:
    """A directory SGLang starts from: ``config.json`` (with ``torch_dtype``) and the tokenizer's
    files, if any. Written under a temporary name, then renamed (never half-written)."""
    root = Path(tempfile.mkdtemp(prefix="megarl-sglang-"))
    partial = root / "partial"
    partial.mkdir()
    if tokenizer is not None:
        source = Path(tokenizer)
        if not source.is_dir():
            raise FileNotFoundError(f"data.tokenizer={tokenizer} is not a directory")
        for file in source.iterdir():
            if file.is_file() and file.name != "config.json":
                shutil.copy2(file, partial / file.name)
    config = dict(hf_config) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(partial, root / "hf")
    return str(root / "hf")


class SGLangRollout(RolloutEngine):
    """SGLang engines of the generation replicas.

    ``groups`` are the generation layout's process groups (``build_placed_groups``); ``hf_dir``
    holds the HF ``config.json`` (and tokenizer files) SGLang starts from; weights are dummies until
    the first sync. Colocated: ``resharder`` is the hybrid engine's, and :meth:`update_weights`
    pushes its shards; split placement: no resharder, :meth:`connect_weights_group` then
    :meth:`receive_weights`. Needs CUDA and the ``sglang`` extra.
    """

    def __init__(self, groups, args: MegatronModelArgs, hf_dir: str, dtype: torch.dtype, resharder=None,
                 mem_fraction: float = 0.5, bucket_bytes: int = 512 << 20, port: int = 30000,
                 vocab_multiple: int = 128, weights_plan: Optional[Sequence[WeightBucket]] = None):
        """Split placement: ``weights_plan`` (:func:`hf_bucket_plan`, the trainer's broadcaster's) and no
        ``resharder``; :meth:`update_weights` then receives the trainer's broadcast."""
        sglang = require_sglang()
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.engine=sglang needs CUDA GPUs; this machine has none "
                               "(rollout.engine=native runs everywhere)")
        if groups.layout.pp != 1 or groups.layout.ep != 1:
            raise ValueError(f"the sglang rollout takes rollout.pp=1 and rollout.ep=1 (got {groups.layout}): "
                             f"each engine receives whole tensors and shards them over its own tp")
        self.resharder, self.groups, self.args = resharder, groups, args
        self.weights_plan = list(weights_plan or [])
        if resharder is None and not self.weights_plan:
            raise ValueError("the sglang rollout needs a resharder (colocated) or a weights_plan (split placement)")
        self.model = ModelSpec.from_args(args, vocab_multiple)
        self.names = HFNames(args, vocab_multiple)
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.tp_rank = groups.pg.tp.rank()
        self.devices = engine_devices(groups.pg.tp)
        self.engine = None
        if self.tp_rank == 0:
            with visible_devices(self.devices):
                self.engine = sglang.Engine(
                    model_path=hf_dir, tp_size=groups.layout.tp, base_gpu_id=0, gpu_id_step=1,
                    load_format="dummy", enable_memory_saver=True, skip_tokenizer_init=True,
                    mem_fraction_static=mem_fraction, host="127.0.0.1", port=port + groups.pg.dp.rank(),
                    dtype=str(dtype).removeprefix("torch."))
        self.sglang_version = getattr(sglang, "__version__", "unknown")
        self.released: set = set()
        if resharder is not None:
            # colocated: until the trainer has offloaded after the first sync, hold the weights only
            self._release(GENERATION)
        self.last = RolloutStats()

    # ---------------------------------------------------------------- memory (colocated)

    def _release(self, tags: Sequence[str]) -> None:
        tags = [t for t in tags if t not in self.released]
        if tags and self.engine is not None:
            self.engine.release_memory_occupation(tags=tags)
        self.released |= set(tags)

    def _resume(self, tags: Sequence[str]) -> None:
        tags = [t for t in tags if t in self.released]  # SGLang refuses to resume what is held
        if tags and self.engine is not None:
            self.engine.resume_memory_occupation(tags=tags)
        self.released -= set(tags)

    def release_memory(self) -> None:
        """Weights, KV cache and CUDA graphs off the GPU while the trainer runs."""
        self._release(WEIGHTS + GENERATION)
        dist.barrier()

    def resume_memory(self) -> None:
        """The weights back (the sync writes them); the KV cache waits for :meth:`resume_kv_cache`."""
        self._resume(WEIGHTS)
        dist.barrier()

    def resume_kv_cache(self) -> None:
        """The KV cache and CUDA graphs back, once the trainer has offloaded: the offloaded tensors'
        blocks go back to the driver first (SGLang's processes cannot use this one's cache), on
        every rank of the engine before its TP rank 0 asks for them."""
        torch.cuda.empty_cache()
        dist.barrier()
        self._resume(GENERATION)
        dist.barrier()

    def flush_cache(self) -> None:
        if self.engine is not None:
            self.engine.flush_cache()

    def shutdown(self) -> None:
        """Stop this rank's engine (its scheduler processes and ports)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---------------------------------------------------------------- weights

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
        """Colocated: the hybrid engine's shards, whole, as CUDA-IPC payloads (one per TP rank)."""
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer

        if self.resharder is None:  # split placement: the trainer's broadcast
            start = time.perf_counter()
            self.receive_weights(self.weights_plan, policy_version)
            self.split_sync = SyncStats(bytes_received=sum(b.nbytes for b in self.weights_plan),
                                        seconds=time.perf_counter() - start)
            return
        if "weights" in self.released:
            raise RuntimeError("SGLang's weights are released; call resume_memory() before update_weights()")
        start = time.perf_counter()
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
        # the sync's seconds include the hand-over to SGLang, not only the reshard
        self.resharder.last.seconds = time.perf_counter() - start
        self.policy_version = policy_version

    def sync_stats(self) -> SyncStats:
        return self.resharder.last if self.resharder is not None else self.split_sync

    def connect_weights_group(self, address: str, port: int, group_name: str = WEIGHTS_GROUP) -> None:
        """Split placement: join the weights group whose rank 0 is the trainer's rank 0 (it calls
        :func:`weights_process_group` with the same address, port and name at the same time). The
        TP workers of replica d are ranks 1 + d*tp ... of 1 + dp*tp."""
        tp, dp = self.groups.layout.tp, self.groups.layout.dp
        if self.engine is not None:
            warning = rendezvous_warning(self.sglang_version)
            if warning:
                warnings.warn(warning, stacklevel=2)
            self.engine.init_weights_update_group(address, port, 1 + self.groups.pg.dp.rank() * tp, 1 + dp * tp,
                                                  group_name, backend="nccl")

    def receive_weights(self, plan: Sequence[WeightBucket], policy_version: int,
                        group_name: str = WEIGHTS_GROUP) -> None:
        """Split placement: take one sync's buckets as the trainer's :class:`SGLangBroadcaster`
        sends them (the same :func:`hf_bucket_plan`), then drop the stale prefix cache."""
        if self.engine is not None:
            for bucket in plan:
                self.engine.update_weights_from_distributed(
                    names=[t.name for t in bucket.tensors], dtypes=[str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
                    shapes=[list(t.shape) for t in bucket.tensors], group_name=group_name, flush_cache=False)
            self.engine.flush_cache()
        dist.barrier()
        self.policy_version = policy_version

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        if "kv_cache" in self.released:
            raise RuntimeError("SGLang's KV cache is released; generate after update_weights() "
                               "(the rollout role resumes it once the trainer has offloaded)")
        begin = time.perf_counter()
        rows = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
        dp, dp_rank = self.groups.layout.dp, self.groups.pg.dp.rank()
        share = -(-len(rows) // dp)
        mine = rows[dp_rank * share:(dp_rank + 1) * share]
        out: List[Response] = []
        if self.engine is not None and mine:
            results = self.engine.generate(input_ids=[list(prompts[p]) for p, _ in mine],
                                           sampling_params=request_params(mine, sampling), return_logprob=True)
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
        merged.sort(key=lambda r: (r.prompt_index, r.sample_index))
        self.last = RolloutStats(prompts=len(prompts), tokens=sum(r.length for r in merged),
                                 seconds=time.perf_counter() - begin)
        return merged


def colocated_rollout(model_cfg, rollout_cfg, args: MegatronModelArgs, regrouping, train_chunks: List[torch.nn.Module],
                      tokenizer: Optional[str] = None) -> SGLangRollout:
    """The SGLang rollout of colocated placement: generation groups and the hybrid engine's
    ``Resharder`` as the native rollout builds them, an HF directory to start from, then the
    engines. ``model_cfg``: cfg.model; ``rollout_cfg``: cfg.parallel.rollout; ``tokenizer``:
    cfg.data.tokenizer. Collective over the world."""
    from megarl.hybrid import Resharder
    from megarl.parallel import LayoutError, build_placed_groups

    require_sglang()
    if not torch.cuda.is_available():
        raise RuntimeError("rollout.engine=sglang needs CUDA GPUs; this machine has none "
                           "(rollout.engine=native runs everywhere)")
    if rollout_cfg.dtype != "auto":
        raise ValueError(f"parallel.rollout.dtype={rollout_cfg.dtype} applies to the native engine; the sglang "
                         f"rollout generates in the actor's dtype (leave it 'auto')")
    positions = sorted(range(len(regrouping.gen_rank)), key=lambda r: regrouping.gen_rank[r])
    try:
        groups = build_placed_groups(regrouping.gen, positions)
    except LayoutError as err:
        raise ValueError(f"rollout layout {regrouping.gen}: {err}") from None
    bucket_bytes = rollout_cfg.bucket_mb << 20
    model = ModelSpec.from_args(args, model_cfg.make_vocab_size_divisible_by)
    resharder = Resharder.create(model, regrouping, train_chunks, bucket_bytes)
    dtype = resharder.dtypes[0]  # the embedding's: the actor's parameter dtype
    hf_dir = write_hf_dir(args.hf_config, dtype, tokenizer) if groups.pg.tp.rank() == 0 else ""
    return SGLangRollout(groups, args, hf_dir, dtype, resharder, mem_fraction=rollout_cfg.mem_fraction_static,
                         bucket_bytes=bucket_bytes, vocab_multiple=model_cfg.make_vocab_size_divisible_by)
