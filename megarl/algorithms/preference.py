"""Preference losses on (chosen, rejected) pairs: the Bradley–Terry loss of a reward model's
scalar scores (``megarl train-rm``, megarl/roles/reward_trainer.py), and DPO's loss of a policy's
sequence log-probs against a frozen reference's, with its label-smoothed and IPO variants
(``megarl dpo``, megarl/roles/dpo.py).

Every function takes per-pair tensors ``[pairs]`` and returns per-pair losses, so the caller
chooses the reduction (a mean over the pairs of the global batch) and the engine's micro-batching
never changes a pair's value.

- Bradley–Terry (Ouyang et al. 2022, eq. 1): ``-log σ(s_c - s_r)``.
- DPO (Rafailov et al. 2023, eq. 7) with h = (log π_c - log π_ref,c) - (log π_r - log π_ref,r):
  ``-log σ(β h)``; label smoothing ε (the conservative DPO of Mitchell 2023, as TRL's and NeMo-RL's
  ``label_smoothing``): ``-(1 - ε) log σ(β h) - ε log σ(-β h)``.
- IPO (Azar et al. 2023, eq. 17): ``(h - 1/(2β))²``.
- The implicit rewards: ``β (log π_c - log π_ref,c)`` and ``β (log π_r - log π_ref,r)``; the reward
  accuracy is the share of pairs whose chosen reward is the larger, the margin their difference.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from megarl.registry import Registry

Tensor = torch.Tensor
DPO_VARIANTS: Registry = Registry("DPO variant")


def bradley_terry(chosen: Tensor, rejected: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per pair: ``-log σ(s_c - s_r)``, and the pair's accuracy (1 when s_c > s_r) and margin."""
    margin = chosen - rejected
    return -F.logsigmoid(margin), {"accuracy": (margin > 0).to(margin.dtype), "margin": margin.detach()}


@DPO_VARIANTS.register("sigmoid")
def _sigmoid(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


@DPO_VARIANTS.register("ipo")
def _ipo(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return (h - 1 / (2 * beta)) ** 2


def dpo(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float,
        variant: str = "sigmoid", label_smoothing: float = 0.0) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per pair: the ``variant``'s loss of the sequence log-probs (sums over each response's tokens),
    and the implicit rewards, their accuracy and margin, and the policy's log-probs."""
    if beta <= 0:
        raise ValueError(f"DPO's beta={beta} must be > 0")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO's label_smoothing={label_smoothing} must be in [0, 0.5)")
    loss_fn = DPO_VARIANTS.get(variant)
    chosen_logratio, rejected_logratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    losses = loss_fn(chosen_logratio - rejected_logratio, beta, label_smoothing)
    chosen_reward, rejected_reward = beta * chosen_logratio.detach(), beta * rejected_logratio.detach()
    margin = chosen_reward - rejected_reward
    return losses, {"chosen_reward": chosen_reward, "rejected_reward": rejected_reward,
                    "accuracy": (margin > 0).to(margin.dtype), "margin": margin,
                    "chosen_logp": policy_chosen.detach(), "rejected_logp": policy_rejected.detach()}
