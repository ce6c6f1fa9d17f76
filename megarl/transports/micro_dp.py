"""Colocated weight sync in process: the 3D-HybridEngine's micro-DP resharding (HybridFlow §5),
the training shards of one model-parallel group gathered among its micro-DP group into the
generation layout on the same ranks (megarl.hybrid: plan, then execute)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megarl.hybrid import Regrouping, Resharder
from megarl.parallel import build_placed_groups
from megarl.transports import WeightReceiver


class MicroDPReceiver(WeightReceiver):
    """The generation layout of ``regrouping`` on the training ranks, fed from ``train_chunks``
    (this rank's training model chunks) in buckets of at most ``bucket_bytes`` extra memory; ``delta``:
syncs after the first send what changed (the generation tensors must keep their values between syncs)."""

    def __init__(self, regrouping: Regrouping, train_chunks: Optional[List[torch.nn.Module]],
                 bucket_bytes: int = 256 << 20, delta: bool = False):
        self.regrouping, self.train_chunks, self.bucket_bytes = regrouping, train_chunks, bucket_bytes
        self.delta = delta

    @property
    def gen(self):
        return self.regrouping.gen

    def place(self, gen):
        rg = self.regrouping
        positions = sorted(range(len(rg.gen_rank)), key=lambda r: rg.gen_rank[r])  # world rank of each gen rank
        return build_placed_groups(gen, positions)

    def bind(self, model, outputs: Optional[Dict[str, torch.Tensor]] = None) -> Resharder:
        return Resharder.create(model, self.regrouping, self.train_chunks, self.bucket_bytes, outputs=outputs,
                                delta=self.delta)

    def bind_buffers(self, model, dtype: torch.dtype) -> Resharder:
        """Generation tensors of ``dtype`` of its own (kept between syncs), the message dtype too."""
        return Resharder.create(model, self.regrouping, self.train_chunks, self.bucket_bytes, delta=self.delta,
                                out_dtype=dtype)

    def shard(self, executor: Resharder, rank: int) -> List:
        return executor.plan.gen[rank]
