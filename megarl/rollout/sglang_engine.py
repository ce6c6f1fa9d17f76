"""SGLang rollout for GPU clusters (optional extra ``sglang``), fed by the 3D-HybridEngine.

One SGLang engine per generation replica, started from the replica's generation-TP rank 0 on
the replica's GPUs with dummy weights and the memory saver. Weights arrive through a transport
(megarl.transports): colocated, the hybrid engine's shards as CUDA-IPC handles
(``update_weights_from_tensor``, :mod:`~megarl.transports.cuda_ipc`); split placement, the
trainer's broadcast of whole HF tensors (``update_weights_from_distributed``,
:mod:`~megarl.transports.nccl_broadcast`).

Devices: each engine spans the GPUs of its replica's t_g generation-TP ranks, SGLang's TP rank i on
rank i's GPU (where rank i's CUDA-IPC payloads live). A Ray worker sees only its own GPU, so the
engine's processes start with ``CUDA_VISIBLE_DEVICES`` set to the node ids of those t_g GPUs and
``base_gpu_id=0`` (:func:`engine_devices`), as verl does for its colocated SGLang engines, and
without torchrun's agent-store flag (:func:`engine_environment`).

Answers: SGLang reports a failed weight update as ``(False, message)`` instead of raising; every
call megarl makes goes through :class:`CheckedEngine`, which raises with the call, the rank and
SGLang's message (:data:`ENGINE_ANSWERS`, checked against the pinned release by the conformance).

Memory (colocated): SGLang's memory saver releases its weights, KV cache and CUDA graphs while
the trainer holds the device, and takes them back in two steps: the weights before the sync, the
KV cache and CUDA graphs only once the trainer has offloaded its states (``resume_kv_cache``), so
that the trainer's states and SGLang's KV cache are never resident together.

The parts that need no GPU (devices, versions, request parameters, the HF directory) are plain
functions, tested on CPU. Pinned: SGLang 0.5.6.post2 (:data:`SGLANG_PIN`, the Dockerfile's base
image); setup.py's extra asks for sglang>=0.5.0. Every SGLang call megarl makes is checked against
that release's source by :mod:`megarl.rollout.sglang_conformance` (no import, no GPU).
"""

from __future__ import annotations

import os
import re
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.config.schema import RolloutDtype
from megarl.hybrid.executor import SyncStats
from megarl.hybrid.shards import ModelSpec
from megarl.models.hf_config import MegatronModelArgs
from megarl.parallel import LayoutError
from megarl.hybrid.hf_names import HFNames
from megarl.rollout.engine_files import engine_env, write_hf_dir
from megarl.rollout.types import (Response, RolloutEngine, RolloutStats, SamplingParams, dp_rows, gather_responses,
                                  row_seeds)


def require_sglang():
    """Import SGLang or say which extra to install."""
    try:
        import sglang
    except ImportError as err:
        raise ImportError("rollout.engine=sglang needs SGLang on a GPU machine: pip install 'megarl[sglang]' "
                          "(or use rollout.engine=native, which runs everywhere)") from err
    return sglang


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


# torchrun's agent exports TORCHELASTIC_USE_AGENT_STORE=True to its workers; torch's tcp:// and
# env:// rendezvous then make every rank a client of the agent's store (_create_c10d_store in
# torch/distributed/rendezvous.py, 2.9 to 2.13; TCPStore's C++ side reads it too). SGLang's
# schedulers meet on a port of their own (tcp://127.0.0.1:<dist port>, and init_weights_update_group's
# group), where no agent hosts a store: inherited, the flag leaves them waiting until the timeout.
# It is the only variable torch's rendezvous reads to decide this (TORCHELASTIC_RUN_ID and the rest
# only describe the launch).
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def engine_environment(ids: Sequence[str]) -> Dict[str, Optional[str]]:
    """What an engine's processes start with on top of this process's environment (for
    :func:`~megarl.rollout.engine_files.engine_env`; None: unset): the node ids of the engine's GPUs
    (SGLang's schedulers inherit them at spawn and take device ``base_gpu_id + tp_rank``), and not
    torchrun's agent-store flag."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids), AGENT_STORE_ENV: None}


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
    return [base | {"sampling_seed": seed} for seed in row_seeds(rows, sampling)]


SGLANG_PIN = "0.5.6.post2"  # the release megarl is written and checked against (the Dockerfile's image)


class SGLangCallFailed(RuntimeError):
    """An SGLang engine call answered that it failed."""


def _success_and_message(answer) -> Tuple[bool, str]:
    success, message = answer
    return bool(success), str(message)


def _flushed(answer) -> Tuple[bool, str]:
    return bool(answer.success), ("the scheduler did not flush its cache: requests were still running "
                                  "(FlushCacheReqOutput.success=False)")


@dataclass(frozen=True)
class Answer:
    """What an Engine method answers in the pinned release: ``returns``, the return annotation of
    the TokenizerManager coroutine it runs (the conformance reads it from the wheel; "None": it
    returns nothing), and ``read``, how megarl reads success and SGLang's message from it (None:
    nothing to check)."""

    returns: Optional[str]
    read: Optional[Callable[[object], Tuple[bool, str]]] = None


# Every Engine method megarl calls (the conformance fails on a call missing here).
ENGINE_ANSWERS: Dict[str, Answer] = {
    "update_weights_from_tensor": Answer("Tuple[bool, str]", _success_and_message),
    "update_weights_from_distributed": Answer("Tuple[bool, str]", _success_and_message),
    "init_weights_update_group": Answer("Tuple[bool, str]", _success_and_message),
    "flush_cache": Answer("FlushCacheReqOutput", _flushed),
    # nothing comes back: the scheduler asserts (and its process dies) when it cannot release
    "release_memory_occupation": Answer("None"),
    "resume_memory_occupation": Answer("None"),
    "generate": Answer(None),  # the outputs, not a TokenizerManager communicator's answer
    "shutdown": Answer(None),  # kills the engine's process tree
}


class CheckedEngine:
    """An ``sglang.Engine`` whose answers are checked (:data:`ENGINE_ANSWERS`): a call that answers
    failure raises :class:`SGLangCallFailed` naming the call, this process's ``rank`` and SGLang's
    message. Other attributes are the engine's own."""

    def __init__(self, engine, rank: int):
        self.engine, self.rank = engine, rank

    def __getattr__(self, name: str):
        value = getattr(self.engine, name)
        answer = ENGINE_ANSWERS.get(name)
        if answer is None or answer.read is None:
            return value

        def call(*args, **kwargs):
            result = value(*args, **kwargs)
            success, message = answer.read(result)
            if not success:
                raise SGLangCallFailed(f"SGLang's Engine.{name} failed on rank {self.rank}: {message}")
            return result

        return call

# SGLang's memory-saver tags (sglang/srt/constants.py): released together, resumed in two steps
WEIGHTS, GENERATION = ("weights",), ("kv_cache", "cuda_graph")


class SGLangRollout(RolloutEngine):
    """SGLang engines of the generation replicas.

    ``groups`` are the generation layout's process groups; ``hf_dir`` holds the HF ``config.json``
    (and tokenizer files) SGLang starts from; weights are dummies until the first sync.
    ``weights`` (megarl.transports) fills them: colocated, a
    :class:`~megarl.transports.cuda_ipc.CudaIpcSender` hands over the hybrid engine's shards in
    process; split placement, a :class:`~megarl.transports.nccl_broadcast.BroadcastReceiver`
    takes the trainer's broadcast (:meth:`connect_weights` first). Needs CUDA and the ``sglang`` extra.
    """

    def __init__(self, groups, args: MegatronModelArgs, hf_dir: str, dtype: torch.dtype, weights,
                 mem_fraction: float = 0.5, port: int = 30000):
        sglang = require_sglang()
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.engine=sglang needs CUDA GPUs; this machine has none "
                               "(rollout.engine=native runs everywhere)")
        if groups.layout.pp != 1 or groups.layout.ep != 1:
            raise ValueError(f"the sglang rollout takes rollout.pp=1 and rollout.ep=1 (got {groups.layout}): "
                             f"each engine receives whole tensors and shards them over its own tp")
        self.groups, self.args, self.weights, self.dtype = groups, args, weights, dtype
        self.tp_rank = groups.pg.tp.rank()
        self.devices = engine_devices(groups.pg.tp)
        self.engine = None
        if self.tp_rank == 0:
            with engine_env(engine_environment(self.devices)):
                engine = sglang.Engine(
                    model_path=hf_dir, tp_size=groups.layout.tp, base_gpu_id=0, gpu_id_step=1,
                    load_format="dummy", enable_memory_saver=True, skip_tokenizer_init=True,
                    mem_fraction_static=mem_fraction, host="127.0.0.1", port=port + groups.pg.dp.rank(),
                    dtype=str(dtype).removeprefix("torch."))
            self.engine = CheckedEngine(engine, dist.get_rank())
        self.sglang_version = getattr(sglang, "__version__", "unknown")
        self.released: set = set()
        if weights.in_process:
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

    def update_weights(self, policy_version: int) -> None:
        if "weights" in self.released:
            raise RuntimeError("SGLang's weights are released; call resume_memory() before update_weights()")
        self.weights.sync(self.engine)
        self.policy_version = policy_version

    def sync_stats(self) -> SyncStats:
        return self.weights.last

    def connect_weights(self, address: str, port: int) -> None:
        """Split placement: join the trainer's weights group (see ``BroadcastReceiver.connect``)."""
        if self.engine is not None:
            warning = rendezvous_warning(self.sglang_version)
            if warning:
                warnings.warn(warning, stacklevel=2)
        self.weights.connect(self.engine, address, port)

    def sync_bytes(self):
        """None: SGLang's engines take whole tensors and keep their shard."""
        return None

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        if "kv_cache" in self.released:
            raise RuntimeError("SGLang's KV cache is released; generate after update_weights() "
                               "(the rollout role resumes it once the trainer has offloaded)")
        begin = time.perf_counter()
        mine, _ = dp_rows(len(prompts), sampling.n, self.groups.layout.dp, self.groups.pg.dp.rank())
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
        merged = gather_responses(out)
        self.last = RolloutStats(prompts=len(prompts), tokens=sum(r.length for r in merged),
                                 seconds=time.perf_counter() - begin)
        return merged


def colocated_rollout(model_cfg, rollout_cfg, args: MegatronModelArgs, regrouping, train_chunks: List[torch.nn.Module],
                      tokenizer: Optional[str] = None) -> SGLangRollout:
    """The SGLang rollout of colocated placement: generation groups and the hybrid engine's
    micro-DP executor as the native rollout places them, an HF directory to start from, then the
    engines, fed by CUDA-IPC hand-over. ``model_cfg``: cfg.model; ``rollout_cfg``:
    cfg.parallel.rollout; ``tokenizer``: cfg.data.tokenizer. Collective over the world."""
    from megarl.transports.cuda_ipc import CudaIpcSender
    from megarl.transports.micro_dp import MicroDPReceiver

    require_sglang()
    if not torch.cuda.is_available():
        raise RuntimeError("rollout.engine=sglang needs CUDA GPUs; this machine has none "
                           "(rollout.engine=native runs everywhere)")
    if rollout_cfg.dtype != RolloutDtype.auto:
        raise ValueError(f"parallel.rollout.dtype={rollout_cfg.dtype} applies to the native engine; the sglang "
                         f"rollout generates in the actor's dtype (leave it 'auto')")
    bucket_bytes = rollout_cfg.bucket_mb << 20
    micro_dp = MicroDPReceiver(regrouping, train_chunks, bucket_bytes)
    try:
        groups = micro_dp.place(regrouping.gen)
    except LayoutError as err:
        raise ValueError(f"rollout layout {regrouping.gen}: {err}") from None
    vocab = model_cfg.make_vocab_size_divisible_by
    model = ModelSpec.from_args(args, vocab)
    resharder = micro_dp.bind(model)
    dtype = resharder.dtypes[0]  # the embedding's: the actor's parameter dtype
    hf_dir = write_hf_dir(args.hf_config, dtype, tokenizer, prefix="megarl-sglang-") if groups.pg.tp.rank() == 0 else ""
    weights = CudaIpcSender(resharder, groups, model, HFNames(args, vocab), bucket_bytes)
    return SGLangRollout(groups, args, hf_dir, dtype, weights, mem_fraction=rollout_cfg.mem_fraction_static)


def split_rollout(model_cfg, rollout_cfg, args: MegatronModelArgs, layout, tokenizer: Optional[str] = None) -> SGLangRollout:
    """The SGLang rollout of split placement: this world's own layout ``layout``, fed by the
    trainer's broadcasts of the same :func:`hf_bucket_plan`."""
    from megarl.models.builder import resolve_dtype
    from megarl.parallel import build_groups
    from megarl.transports.nccl_broadcast import BroadcastReceiver, hf_bucket_plan

    groups = build_groups(layout)
    dtype = resolve_dtype(model_cfg.params_dtype)  # the trainer's parameters', as the broadcast sends them
    vocab = model_cfg.make_vocab_size_divisible_by
    hf_dir = write_hf_dir(args.hf_config, dtype, tokenizer, prefix="megarl-sglang-") if groups.tp_rank == 0 else ""
    weights = BroadcastReceiver(hf_bucket_plan(args, dtype, rollout_cfg.bucket_mb << 20, vocab), groups)
    return SGLangRollout(groups, args, hf_dir, dtype, weights, mem_fraction=rollout_cfg.mem_fraction_static)
