"""RL algorithms as pure torch functions: advantage estimators, KL estimators and losses.

Layout-independent: explicit ``[batch, response_len]`` / ``[batch]`` tensors in, no configs or
process groups. Extension points are the three registries.
"""

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator, AdvantageInputs
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLEstimator,
    kl_penalty_rewards,
)
from megarl.algorithms.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLoss,
    aggregate,
    entropy_bonus,
    kl_loss,
    loss_denominators,
    value_loss,
)
from megarl.algorithms.masked import masked_mean, masked_mean_var, masked_whiten, whiten_with_stats
from megarl.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "FixedKLController",
    "KLController",
    "KLEstimator",
    "PolicyLoss",
    "Registry",
    "aggregate",
    "entropy_bonus",
    "kl_loss",
    "kl_penalty_rewards",
    "loss_denominators",
    "masked_mean",
    "masked_mean_var",
    "masked_whiten",
    "value_loss",
    "whiten_with_stats",
]
