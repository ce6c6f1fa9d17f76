"""Split-placement weight sync point to point: over a group spanning the trainer's world and the
rollout's, every rollout rank receives exactly its generation shard from the training ranks
that hold it (plan and bytes: megarl.hybrid.transfer)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.hybrid.transfer import ShardReceiver, ShardSender, TransferPlan, connect
from megarl.parallel import build_groups
from megarl.runtime import set_seed
from megarl.runtime.devices import compute_device
from megarl.transports import WeightReceiver, WeightSender


class P2PSender(WeightSender):
    """A training rank's share of every rollout rank's shard."""

    def __init__(self, plan: TransferPlan, train_chunks: List[torch.nn.Module]):
        self.shards = ShardSender(plan, dist.get_rank(), train_chunks)

    def connect(self, address: str, port: int) -> None:
        self.shards.connect(connect(address, port, self.shards.rank, self.shards.plan.world_size))

    def send(self) -> int:
        return self.shards.sync().bytes_sent

    def last_stats(self):
        return self.shards.last


class P2PReceiver(WeightReceiver):
    """The rollout's own world in layout ``plan.gen``; ``seed`` seeds its groups' RNG."""

    def __init__(self, plan: TransferPlan, seed: int = 0):
        self.plan, self.seed = plan, seed

    @property
    def gen(self):
        return self.plan.gen

    def place(self, gen):
        groups = build_groups(gen)  # the rollout's world is its own: its layout is Megatron's primary one
        set_seed(self.seed, groups)  # Megatron's parallel layers fork its CUDA RNG tracker while built on a GPU
        return groups

    def bind(self, model, outputs: Optional[Dict[str, torch.Tensor]] = None) -> ShardReceiver:
        return ShardReceiver(self.plan, dist.get_rank(), outputs or {})

    def bind_buffers(self, model, dtype: torch.dtype) -> ShardReceiver:
        """Buffers of ``dtype`` for this rank's shard (the senders cast into them)."""
        mine = self.plan.shards[dist.get_rank()]
        device = compute_device()
        return self.bind(model, {t.name: torch.empty(t.shape, dtype=dtype, device=device) for t in mine})

    def shard(self, executor: ShardReceiver, rank: int) -> List:
        return self.plan.shards[rank]

    def connect(self, address: str, port: int, executor: ShardReceiver) -> None:
        executor.connect(connect(address, port, executor.rank, self.plan.world_size))

    def sync_bytes(self, executor: ShardReceiver) -> Optional[Tuple[int, int]]:
        return executor.last.dense_received, executor.shard_bytes()  # delta: what a full sync would move
