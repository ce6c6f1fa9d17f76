"""PRIME's implicit process reward model (Cui et al. 2025, "Process Reinforcement through Implicit
Rewards", arXiv:2502.01456): a causal LM trained online, whose token rewards are its log-likelihood
ratio to a frozen reference, over a :class:`MegatronEngine` in the actor's layout.

- Token rewards (eq. 3): r_t = beta * (log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)).
- Update (eq. 5): binary cross-entropy of sigma(beta * sum_t (log pi_phi - log pi_ref)) against
  the outcome label of each response, one mean over the step's responses.

The reference is the PRM's starting weights: the policy's reference engine when the PRM starts from
the policy (its log-probs are then the batch's ``ref_log_probs``, computed once), else a frozen copy
of ``reward_model.path``. Input tensors, [rows, seq]: ``tokens``, ``labels``, ``position_ids``,
``loss_mask``, ``prm_labels`` (the update's outcome label on each response token).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F

from megarl.algorithms.masked import select_valid
from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching, MiniBatches
from megarl.metrics import Metric
from megarl.protocol import Dispatch, verb


def implicit_process_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                             beta: float) -> torch.Tensor:
    """[rows, seq]: beta * (logp - ref_logp) on the response tokens, 0 elsewhere."""
    return beta * (select_valid(logp, mask) - select_valid(ref_logp, mask))


def prm_bce(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
            beta: float) -> tuple:
    """Per response (rows with a response token): the sequence logit z = beta * sum_t (logp -
    ref_logp) and BCE(sigma(z), y) = softplus(z) - y z (as logits, stable); y is ``labels`` [rows,
    seq] read on the response tokens. Returns (losses [rows], z [rows], y [rows], has_response)."""
    valid = mask.bool()
    z = implicit_process_rewards(logp, ref_logp, mask, beta).sum(-1)
    tokens = valid.sum(-1)
    y = select_valid(labels, mask).sum(-1) / tokens.clamp(min=1)
    losses = F.binary_cross_entropy_with_logits(z, y.to(z.dtype), reduction="none")
    return losses, z, y, tokens > 0


class ImplicitPRM:
    """The implicit PRM in its training layout, with its frozen reference."""

    def __init__(self, engine: MegatronEngine, reference: MegatronEngine, beta: float, temperature: float,
                 shares_policy_reference: bool):
        if engine.vocab_size is None:
            raise ValueError("the implicit PRM is a causal LM: its engine needs the LM head")
        self.engine, self.reference = engine, reference
        self.beta, self.temperature = beta, temperature
        self.shares_policy_reference = shares_policy_reference

    def _ref_log_probs(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        if self.shares_policy_reference and "ref_log_probs" in batch:  # the policy's reference ran already
            return batch["ref_log_probs"]
        return self.reference.forward_log_probs(batch, lengths, how, self.temperature)["log_probs"]

    @verb(Dispatch.DP, output="process_rewards")
    def compute_rewards(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        logp = self.engine.forward_log_probs(batch, lengths, how, self.temperature)["log_probs"]
        return implicit_process_rewards(logp, self._ref_log_probs(batch, lengths, how), batch["loss_mask"], self.beta)

    def _loss(self, logp: torch.Tensor, _entropy, t: Tensors):
        losses, z, y, rows = prm_bce(logp, t["prm_ref_log_probs"], t["loss_mask"], t["prm_labels"], self.beta)
        count = rows.sum()
        loss = torch.where(rows, losses, 0.0).sum()  # the engine divides by the responses of the step
        with torch.no_grad():
            right = ((z > 0) == (y > 0.5)) & rows
            metrics = {"acc": Metric(right.sum().to(z.dtype)),
                       "score_mean": Metric(torch.where(rows, torch.sigmoid(z), 0.0).sum())}
        return loss, count, metrics

    @verb(Dispatch.DP, optimizer_steps=True, metrics_prefix="prm/")
    def update(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching,
               mini: Optional[MiniBatches] = None) -> Dict[str, float]:
        """Optimizer steps of the cross-entropy over ``batch`` (this DP rank's rows), one per
        mini-batch and epoch, as the actor's; the reference's log-probs stay those of the batch."""
        with torch.no_grad():
            ref = self._ref_log_probs(batch, lengths, how)
        return self.engine.update({**batch, "prm_ref_log_probs": ref}, lengths, self._loss, how, self.temperature,
                                  mini)
