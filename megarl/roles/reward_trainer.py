"""The reward model's learner of ``megarl train-rm``: a value head on the backbone, scored at each
sequence's last token (where transformers' ``*ForSequenceClassification`` scores), trained with
the Bradley–Terry loss on (chosen, rejected) pairs (megarl.algorithms.preference). A batch's rows
are its pairs interleaved, chosen then rejected; the data-parallel shares and the micro-batches
are whole pairs. Every rank gets the step's whole batch and takes its share."""

from __future__ import annotations

from typing import Dict

import torch

from megarl.algorithms.preference import bradley_terry
from megarl.engines import supervised
from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.metrics import Metric
from megarl.parallel.layout import ParallelGroups
from megarl.protocol import Dispatch, verb
from megarl.runtime.devices import to_device


def pair_scores(values: torch.Tensor, mask: torch.Tensor):
    """(chosen, rejected) scores [pairs] from per-token values [rows, seq] and the one-hot mask of
    each row's scored token; rows alternate chosen, rejected."""
    scores = (values * mask).sum(-1)
    return scores[0::2], scores[1::2]


class RewardLearner:
    def __init__(self, engine: MegatronEngine, groups: ParallelGroups, how: MicroBatching):
        if engine.vocab_size is not None:
            raise ValueError("the reward model's engine needs a value head (build_train_state(value_head=True))")
        if how.micro_batch_size % 2:
            raise ValueError(f"micro-batches of {how.micro_batch_size} rows would split a (chosen, rejected) pair")
        self.engine, self.groups, self.how = engine, groups, how

    @staticmethod
    def _loss(values: torch.Tensor, _unused, t: Tensors):
        chosen, rejected = pair_scores(values, t["loss_mask"].float())
        losses, metrics = bradley_terry(chosen, rejected)
        count = torch.tensor(chosen.shape[0], device=values.device)
        return losses.sum(), count, {k: Metric(v.sum()) for k, v in metrics.items()}  # the engine averages

    @verb(Dispatch.ALL)
    def train_step(self, batch: Tensors) -> Dict[str, float]:
        """One optimizer step on the global batch of pairs (this rank's share): the mean Bradley–Terry
        ``loss``, the pairs' ``accuracy`` (chosen scored higher) and ``margin``, ``grad_norm``, ``lr``."""
        shard = to_device(supervised.dp_shard(batch, self.groups))
        metrics = self.engine.update(shard, supervised.row_lengths(shard), self._loss, self.how)
        return {"loss": metrics["loss"], "accuracy": metrics["accuracy"], "margin": metrics["margin"],
                "grad_norm": metrics["grad_norm"], "lr": self.engine.state.optimizer.param_groups[0]["lr"],
                "update_ok": 1.0 - metrics["skipped_steps"]}

    @verb(Dispatch.ALL)
    def scores(self, batch: Tensors) -> torch.Tensor:
        """Each row's score [rows] (every rank gathers the global batch's), no update."""
        shard = supervised.dp_shard(batch, self.groups)
        out = self.engine.forward_log_probs(to_device(shard), supervised.row_lengths(shard), self.how)
        mine = (out["values"] * to_device(shard["loss_mask"]).float()).sum(-1)
        parts = [torch.empty_like(mine) for _ in range(self.groups.layout.dp)]
        torch.distributed.all_gather(parts, mine.contiguous(), group=self.groups.pg.dp)
        return torch.cat(parts).cpu()
