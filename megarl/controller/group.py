"""Worker groups: one Ray actor per rank, all ranks one ``torch.distributed`` world.

A group dispatches a :class:`Batch` by data-parallel rank (every TP/PP rank of one DP index gets
the same chunk) and collects results from tensor-parallel rank 0 of the last pipeline stage.
"""

from __future__ import annotations

import socket
from typing import Any, Dict, List, Optional

import ray

from megarl.controller.protocol import Batch


def rendezvous_address(local: bool):
    """(address, free port) on this node: loopback when the whole run is on one machine."""
    address = "127.0.0.1" if local else ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((address, 0))
        return address, s.getsockname()[1]


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls`` forming one process group."""

    def __init__(self, worker_cls, world_size: int, config, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 env: Optional[Dict[str, str]] = None):
        remote = ray.remote(worker_cls)
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.workers = [
            remote.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
                           runtime_env={"env_vars": env}).remote(rank, world_size, config)
            for rank in range(world_size)]
        # Rank 0's node hosts the torch.distributed rendezvous (loopback when all is local).
        master_addr, port = ray.get(self.workers[0].rendezvous.remote())
        self.info: List[Dict[str, Any]] = self.call("setup", master_addr, port)

    @property
    def dp(self) -> int:
        return self.info[0]["dp"]

    def call(self, method: str, *args, **kwargs) -> List[Any]:
        """Run ``method`` on every rank (SPMD) and return every rank's result."""
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_first(self, method: str, *args, **kwargs) -> Any:
        """Run on every rank; return rank 0's result."""
        return self.call(method, *args, **kwargs)[0]

    def call_dp(self, method: str, batch: Batch, **kwargs) -> Any:
        """Each rank gets its DP index's chunk; results (Batch or dict) of the collecting ranks,
        in DP order: Batches concatenated, dicts from DP rank 0 (already reduced)."""
        chunks = batch.chunk(self.dp)
        futures = [getattr(w, method).remote(chunks[info["dp_rank"]], **kwargs)
                   for w, info in zip(self.workers, self.info)]
        results = ray.get(futures)
        collected = sorted(((info["dp_rank"], r) for info, r in zip(self.info, results) if info["collect"]),
                           key=lambda x: x[0])
        outputs = [r for _, r in collected]
        return Batch.concat(outputs) if isinstance(outputs[0], Batch) else outputs[0]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


class Proxy:
    """A role as the loop sees it: verbs that run on the group, by DP chunk or SPMD."""

    def __init__(self, group: WorkerGroup, prefix: str, dp_verbs=(), spmd_verbs=()):
        self._group, self._prefix = group, prefix
        self._dp, self._spmd = set(dp_verbs), set(spmd_verbs)

    def __getattr__(self, verb: str):
        method = f"{self._prefix}_{verb}"
        if verb in self._dp:
            return lambda batch, **kw: self._group.call_dp(method, batch, **kw)
        if verb in self._spmd:
            return lambda *a, **kw: self._group.call_first(method, *a, **kw)
        raise AttributeError(f"role '{self._prefix}' has no verb '{verb}'")
