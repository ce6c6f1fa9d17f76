"""The supervised learner of ``megarl sft``: a causal LM trained on next-token cross entropy over
the masked tokens (megarl.engines.supervised's loss, the real vocabulary's softmax), and the same
loss forward-only on held-out rows. Every rank gets the step's whole batch and takes its
data-parallel share."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megarl.engines import supervised
from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.parallel.layout import ParallelGroups
from megarl.protocol import Dispatch, verb
from megarl.runtime.devices import to_device


class SupervisedLM:
    def __init__(self, engine: MegatronEngine, groups: ParallelGroups, how: MicroBatching):
        self.engine, self.groups, self.how = engine, groups, how

    @verb(Dispatch.ALL)
    def train_step(self, batch: Tensors) -> Dict[str, float]:
        """One optimizer step on the global batch (this rank's share): the token-mean ``loss``,
        ``grad_norm``, ``lr`` and ``update_ok``; ``tokens``, the trained tokens of the global batch."""
        metrics = supervised.train_step(self.engine, supervised.dp_shard(batch, self.groups), self.how)
        return metrics | {"tokens": float(batch["loss_mask"].sum())}

    @verb(Dispatch.ALL)
    def eval_loss(self, batch: Tensors) -> Tuple[float, float]:
        """(the summed cross entropy of the global batch's masked tokens, their count), no update."""
        shard = supervised.dp_shard(batch, self.groups)
        out = self.engine.forward_log_probs(to_device(shard), supervised.row_lengths(shard), self.how)
        mask = to_device(shard["loss_mask"]).float()
        total = torch.stack([-(out["log_probs"] * mask).sum(), mask.sum()]).double()
        torch.distributed.all_reduce(total, group=self.groups.pg.dp)
        return total[0].item(), total[1].item()
