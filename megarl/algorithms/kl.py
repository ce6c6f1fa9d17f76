"""KL divergence to a reference policy: per-token estimators, reward shaping and coefficient control.

Estimators take the sampled tokens' log-probs under the current policy (``logp``, the sampling
distribution) and the reference (``ref_logp``), both ``[batch, T]``, and estimate KL(pi || ref).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from megarl.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

LOG_RATIO_BOUND = 20.0
"""Bound on a log-ratio of two policies' log-probs before it is exponentiated. exp(20) = 4.9e8 is
far beyond any clip range (PPO's 1 +- 0.2, dual clip's c ~ 3), so no loss value changes where the
ratio matters, and exp(x) and its gradient stay finite in fp32 and bf16 (exp(89) overflows fp32:
a log-ratio of 100 would give inf and then a NaN gradient). Beyond the bound the gradient is 0."""


def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """``log_ratio`` clamped to +-:data:`LOG_RATIO_BOUND`."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log(pi/ref): unbiased for KL(pi || ref), high variance, can be negative
    (Schulman 2020, "Approximating KL Divergence", k1)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 * log(pi/ref)^2: biased, low variance, >= 0 (Schulman 2020, "Approximating KL
    Divergence", k2)."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ref/pi - 1 - log(ref/pi): unbiased, low variance, >= 0 since e^x >= 1 + x (Schulman 2020,
    "Approximating KL Divergence", k3; the KL term of GRPO, Shao et al. 2024 eq. 4). The
    log-ratio is clamped (:data:`LOG_RATIO_BOUND`) so that the exponential stays finite."""
    log_ratio = clamp_log_ratio(ref_logp - logp)
    return torch.exp(log_ratio) - log_ratio - 1


def kl_penalty_rewards(token_rewards: Tensor, kl: Tensor, coef: float, mask: Tensor) -> Tensor:
    """Reward shaping r_t - coef * KL_t at valid tokens, 0 elsewhere (Ziegler et al. 2019, §2.2;
    Ouyang et al. 2022, eq. 2). ``kl`` is a per-token estimate, e.g. ``k1(logp, ref_logp)``."""
    return (token_rewards - coef * kl) * mask.to(token_rewards.dtype)


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so trainers treat both controllers alike."""


class AdaptiveKLController:
    """Drives the observed KL towards ``target`` (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", §2.2): beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n/horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target=}, {horizon=}")
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """``n_steps``: samples (or steps) since the last update, in the unit of ``horizon``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
