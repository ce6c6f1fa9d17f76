"""vLLM on GPUs: each bucket of whole HF tensors enters the engine through vLLM's own ``ipc``
weight-transfer engine (vllm.distributed.weight_transfer.ipc_engine), without a host copy or a file.

vLLM's loaders take checkpoint-format tensors and cut their own tensor-parallel slice
(``QKVParallelLinear``, ``MergedColumnParallelLinear`` and the vocabulary-parallel embedding narrow
by their TP rank), so every worker of an engine needs the whole HF tensors of what moves. The
engine joins the generation shards over the generation TP group on the device (NCCL, within the
node); vLLM's worker ``i`` runs on the GPU of generation-TP rank ``i`` (the engine's
``CUDA_VISIBLE_DEVICES``, megarl.rollout.vllm_engine) and opens rank ``i``'s copy by CUDA IPC: the
bytes do not move again. The update info is vLLM's per-worker list (``Worker.update_weights``
indexes it by the worker's rank), each entry holding only that worker's handles, keyed by its GPU's
UUID as vLLM looks them up. The handles travel pickled (``ipc_handles_pickled``): the engine core's
message channel carries no tensor classes, so the engine's processes start with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (its only client is this rank).
"""

from __future__ import annotations

import base64
import pickle
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.multiprocessing import reductions

from megarl.hybrid.hf_names import NamedTensors
from megarl.transports import EngineHandOver, HandOverCall


def device_uuid() -> str:
    """This rank's GPU as vLLM's IPC engine names it (``str(get_device_properties(i).uuid)``)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def ipc_handle(tensor: torch.Tensor) -> tuple:
    """The CUDA-IPC handle of ``tensor`` (``rebuild_cuda_tensor``'s arguments)."""
    return reductions.reduce_tensor(tensor)[1]


def update_info(entries: List[tuple]) -> Dict[str, object]:
    """One worker's ``IPCWeightTransferUpdateInfo`` (unpacked) from its rank's (name, dtype name,
    shape, {GPU UUID: handle}) entries."""
    return {"names": [e[0] for e in entries], "dtype_names": [e[1] for e in entries],
            "shapes": [list(e[2]) for e in entries],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps([e[3] for e in entries])).decode()}


class IpcHandOver(EngineHandOver):
    """Hands one replica's buckets to its engine (``call``: collective_rpc on the engine, on
    generation-TP rank 0 only) by vLLM's ``ipc`` engine. ``tp_group``: the generation TP group."""

    on_host = False

    def __init__(self, tp_group, keeps_weights: bool):
        self.tp_group, self.keeps_weights = tp_group, keeps_weights
        self.uuid = device_uuid()

    @property
    def sleep_level(self) -> int:
        """2 (weights discarded) when every sync replaces every weight; 1 (kept on the host) when
        a sync may leave some in place (frozen tensors, LoRA's base under lora_sync=adapter)."""
        return 1 if self.keeps_weights else 2

    def engine_kwargs(self) -> Dict[str, object]:
        return {"weight_transfer_config": {"backend": "ipc"}}

    def engine_env(self) -> Dict[str, str]:
        return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

    def connect(self, call: Optional[HandOverCall]) -> None:
        if call is not None:
            call("init_weight_transfer_engine", init_info={"packed": False})

    def begin(self, call: Optional[HandOverCall]) -> None:
        if call is not None:
            call("start_weight_update")

    def bucket(self, call: Optional[HandOverCall], named: NamedTensors) -> int:
        """Each worker opens its own rank's copy of the bucket; the handles' memory lives until every
        worker has loaded it (the TP group's barrier). Collective over the generation TP group."""
        mine = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), {self.uuid: ipc_handle(t)})
                for name, t in named]
        ranks = dist.get_process_group_ranks(self.tp_group)
        gathered = [None] * len(ranks) if call is not None else None
        dist.gather_object(mine, gathered, dst=ranks[0], group=self.tp_group)
        if call is not None:
            for rank, entries in zip(ranks, gathered):
                got = [(e[0], e[2]) for e in entries]
                if got != [(e[0], e[2]) for e in mine]:
                    raise AssertionError(f"generation-TP rank {rank} built bucket {got[:3]}..., rank {ranks[0]} "
                                         f"{[(e[0], e[2]) for e in mine][:3]}...")
            call("update_weights", update_info=[update_info(entries) for entries in gathered])
        dist.barrier(group=self.tp_group)
        return 0

    def end(self, call: Optional[HandOverCall]) -> None:
        if call is not None:
            call("finish_weight_update")
        torch.cuda.ipc_collect()  # the handed tensors' IPC references, released by the workers

