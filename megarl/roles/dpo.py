"""The policy learner of ``megarl dpo``: a causal LM trained with DPO's loss on (chosen, rejected)
pairs (megarl.algorithms.preference.dpo: ``algorithm.dpo_loss``, ``dpo_beta``,
``dpo_label_smoothing``) against a frozen reference, the starting weights: a copy in the same layout,
or with LoRA the same model with its adapters off. A sequence's log-prob is the sum over its
response tokens (the loss mask of megarl sft's rows). A batch's rows are its pairs interleaved,
chosen then rejected; the data-parallel shares and the micro-batches are whole pairs."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

from megarl.algorithms.preference import dpo
from megarl.engines import supervised
from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.metrics import Metric
from megarl.models import lora
from megarl.parallel.layout import ParallelGroups
from megarl.protocol import Dispatch, verb
from megarl.runtime.devices import to_device

METRICS = ("accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp")


class DPOLearner:
    def __init__(self, engine: MegatronEngine, reference: MegatronEngine, groups: ParallelGroups, how: MicroBatching,
                 beta: float, variant: str = "sigmoid", label_smoothing: float = 0.0):
        """``reference``: a frozen engine, or ``engine`` itself when its model has LoRA adapters (run with them off)."""
        if how.micro_batch_size % 2:
            raise ValueError(f"micro-batches of {how.micro_batch_size} rows would split a (chosen, rejected) pair")
        if reference is engine and not lora.has_lora(engine.state.model):
            raise ValueError("the reference is the policy's own engine only with LoRA adapters (switched off)")
        self.engine, self.reference, self.groups, self.how = engine, reference, groups, how
        self.beta, self.variant, self.label_smoothing = beta, variant, label_smoothing

    def _reference_log_probs(self, shard: Tensors, lengths: torch.Tensor) -> torch.Tensor:
        off = lora.adapters_off(self.engine.state.model) if self.reference is self.engine else contextlib.nullcontext()
        with off:
            return self.reference.forward_log_probs(shard, lengths, self.how)["log_probs"]

    def _loss(self, log_probs: torch.Tensor, _entropy, t: Tensors):
        mask = t["loss_mask"].float()
        policy, ref = (log_probs * mask).sum(-1), (t["ref_log_probs"] * mask).sum(-1)
        losses, metrics = dpo(policy[0::2], policy[1::2], ref[0::2], ref[1::2], self.beta, self.variant,
                              self.label_smoothing)
        count = torch.tensor(losses.shape[0], device=log_probs.device)
        return losses.sum(), count, {k: Metric(metrics[k].sum()) for k in METRICS}  # the engine averages

    def _shard(self, batch: Tensors):
        shard = to_device(supervised.dp_shard(batch, self.groups))
        lengths = supervised.row_lengths(shard)
        return shard | {"ref_log_probs": self._reference_log_probs(shard, lengths)}, lengths

    @verb(Dispatch.ALL)
    def train_step(self, batch: Tensors) -> Dict[str, float]:
        """One optimizer step on the global batch of pairs (this rank's share): the mean DPO
        ``loss``, the implicit rewards' ``accuracy`` and ``margin``, the mean chosen and rejected
        rewards and sequence log-probs, ``grad_norm``, ``lr``."""
        shard, lengths = self._shard(batch)
        metrics = self.engine.update(shard, lengths, self._loss, self.how)
        return {k: metrics[k] for k in ("loss", "grad_norm", *METRICS)} | {
            "lr": self.engine.state.optimizer.param_groups[0]["lr"], "update_ok": 1.0 - metrics["skipped_steps"]}

    def forward_backward(self, batch: Tensors) -> Dict[str, float]:
        """The gradients of one pass (in the DDP buffers, reduced) and its metrics, no step (the parity tests)."""
        shard, lengths = self._shard(batch)
        return self.engine.forward_backward(shard, lengths, self._loss, self.how)

    @verb(Dispatch.ALL)
    def eval_pairs(self, batch: Tensors) -> Dict[str, float]:
        """Sums over the global batch's pairs of the loss and the metrics, and the pair count, no
        update (a last batch's padding pairs, trained nowhere, left out)."""
        shard, lengths = self._shard(batch)
        mask = shard["loss_mask"].float()
        policy = (self.engine.forward_log_probs(shard, lengths, self.how)["log_probs"] * mask).sum(-1)
        ref = (shard["ref_log_probs"] * mask).sum(-1)
        losses, metrics = dpo(policy[0::2], policy[1::2], ref[0::2], ref[1::2], self.beta, self.variant,
                              self.label_smoothing)
        real = (mask.sum(-1)[0::2] > 0).double()
        sums = torch.stack([(losses.double() * real).sum(), real.sum()]
                           + [(metrics[k].double() * real).sum() for k in METRICS])
        torch.distributed.all_reduce(sums, group=self.groups.pg.dp)
        return dict(zip(("loss", "pairs", *METRICS), sums.tolist()))
