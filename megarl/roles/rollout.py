"""The rollout as a role: the verbs the RL loop calls on a :class:`RolloutEngine` (native or
SGLang), with the weight sync's cost as metrics."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.engines.offload import PhaseOffload
from megarl.protocol import Dispatch, verb
from megarl.rollout.types import Response, RolloutEngine, SamplingParams


def world_sync_metrics(s) -> Dict[str, float]:
    """Over this world's ranks (collective): ``sync/peak_extra_mb`` (the largest extra memory a rank
    held during the sync: buffers in flight and temporaries), ``sync/delta_copy_mb`` (the largest copy a
    sender keeps of what it last sent, weight_sync=delta) and ``sync/bytes_fraction`` (bytes received
    over what a full sync receives: 1 for full, the delta's share otherwise)."""
    from megarl.runtime.devices import group_device

    peaks = torch.tensor([s.peak_extra_bytes, s.delta_copy_bytes], dtype=torch.float64)
    sums = torch.tensor([s.bytes_received, s.dense_received], dtype=torch.float64)
    if dist.is_initialized():  # NCCL's collectives take device tensors
        peaks, sums = peaks.to(group_device()), sums.to(group_device())
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
    (peak, copy), (received, dense) = peaks.tolist(), sums.tolist()
    out = {"sync/peak_extra_mb": peak / 2**20, "sync/delta_copy_mb": copy / 2**20}
    if dense:
        out["sync/bytes_fraction"] = received / dense
    return out


class Rollout:
    """Generation for the loop; every verb is collective over the world (the hybrid engine)."""

    def __init__(self, engine: RolloutEngine, phases: Optional[PhaseOffload] = None):
        self.engine = engine
        self.phases = phases  # colocated: the trained states off the device while generating, memory per phase

    @verb(Dispatch.ALL)
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        return self.engine.generate(prompts, sampling)

    @verb(Dispatch.ALL)
    def begin(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        """A partial rollout's start (``parallel.rollout.partial_rollout``): see :meth:`advance`."""
        self.engine.begin(prompts, sampling)

    @verb(Dispatch.ALL)
    def admit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, first_index: int) -> None:
        """Sample-level streaming (``trainer.loop=async``): more requests into the rollout in flight."""
        self.engine.admit(prompts, sampling, first_index)

    @verb(Dispatch.ALL)
    def advance(self, max_tokens: Optional[int] = None) -> Tuple[List[Response], int]:
        """Up to ``max_tokens`` more tokens of each unfinished response: (the responses that ended,
        how many are still in flight). Weight syncs may come between two calls."""
        done = self.engine.advance(max_tokens)
        return done, self.engine.in_flight()

    @verb(Dispatch.ALL)
    def update_weights(self, policy_version: int) -> Dict[str, float]:
        """Sync the actor's weights; the sync's seconds and the bytes this rank received. Then the
        trained states leave the device and only then does the engine take its KV cache back, so
        the two are never resident together."""
        self.engine.update_weights(policy_version)
        s = self.engine.sync_stats()
        metrics = {"sync/seconds": s.seconds, "sync/bytes_received": s.bytes_received} | world_sync_metrics(s)
        if getattr(s, "engine_bytes", 0):  # what an external engine (vLLM) was handed after the reshard
            metrics["sync/engine_bytes"] = s.engine_bytes
        if self.phases is not None:
            metrics.update(self.phases.enter_generate())
        self.engine.resume_kv_cache()
        return metrics

    @verb(Dispatch.ALL)
    def release_memory(self) -> None:
        self.engine.release_memory()
        if self.phases is not None:
            self.phases.enter_train()

    @verb(Dispatch.ALL)
    def resume_memory(self) -> None:
        """The engine's weights memory back for the sync (its KV cache follows the offload)."""
        self.engine.resume_memory()
