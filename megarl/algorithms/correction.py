"""Rollout correction: importance weights for the train-inference mismatch.

The rollout engine samples from pi_rollout (another precision, other kernels) while the loss
treats the samples as drawn from pi_old, the trainer's policy before the update. Weighting each
token's policy loss by pi_old / pi_rollout corrects the bias; truncating (TIS) or masking (MIS) the
weight bounds its variance (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", truncated IS; Liu, Yao et al. 2025, "When Speed Kills Stability", MIS).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from megarl.algorithms.kl import clamp_log_ratio
from megarl.algorithms.masked import masked_mean, select_valid
from megarl.config.schema import RolloutCorrection
from megarl.metrics import Metric, Reduce

ROLLOUT_CORRECTIONS = tuple(RolloutCorrection)  # algorithm.rollout_correction
"""``none``; ``token_*``: w_t = pi_old(y_t) / pi_rollout(y_t) per token; ``seq_*``: one weight per
response, w = prod_t w_t = exp(sum_t log w_t), on all its tokens. ``*_tis`` truncates (min(w, C));
``*_mis`` masks (w where w <= C, else 0: the token or the whole response leaves the loss).
``icepop`` masks per token on both sides: w where alpha <= w <= beta (= C), else 0 (IcePop, Ling
Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
Model", §2: double-sided masking of the training-inference probability ratio)."""


def check_rollout_correction(mode: RolloutCorrection, threshold: float, low: float = 0.5) -> None:
    """Raise ``ValueError`` naming the ``algorithm.*`` field that is wrong."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"algorithm.rollout_correction='{mode}' must be one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if not 1 < threshold < math.inf:  # also refuses NaN
        raise ValueError(f"algorithm.rollout_correction_threshold={threshold} must be a finite number > 1 "
                         f"(the bound C on the importance weight pi_old / pi_rollout; 2 is common)")
    if not 0 < low < 1:
        raise ValueError(f"algorithm.rollout_correction_threshold_low={low} must be in (0, 1) (IcePop's lower "
                         f"bound on pi_old / pi_rollout; 0.5 is IcePop's)")


@torch.no_grad()
def rollout_correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: RolloutCorrection,
                               threshold: float, low: float = 0.5) -> Tuple[Optional[Tensor], Dict[str, Metric]]:
    """(weights ``[batch, T]``, metrics) from the trainer's old log-probs and the rollout's, both
    ``[batch, T]``; weights are None for ``none``, detached constants otherwise, 0 off the mask.

    Masked positions are selected away before any arithmetic (inf or NaN there changes nothing);
    log-ratios are clamped to +-LOG_RATIO_BOUND per token and, for sequences, again after the sum.
    MIS masks only above C: the MIS of Liu, Yao et al. (rho * 1{rho <= C}); a lower bound 1/C
    (rejection sampling on both sides) is not applied.

    Metrics (micro-batch means over valid tokens, 0-d; the maxima reduce as maxima): ``kl``, the k3 estimate of
    KL(pi_rollout || pi_old) on the rollout's own samples, at every mode; with a correction also
    ``weight_mean`` and ``weight_max`` (the applied weights), ``ratio_max`` (before truncation or
    masking) and ``frac_truncated`` (TIS) or ``frac_masked`` (MIS): the share of valid tokens whose
    weight exceeded C (for ``seq_*``, the tokens of such responses; for ``icepop``, whose weight
    fell outside [low, C]).
    """
    check_rollout_correction(mode, threshold, low)
    valid = mask.bool()
    old, rollout = select_valid(old_logp, mask), select_valid(rollout_logp, mask)
    log_ratio = clamp_log_ratio(old - rollout)  # [batch, T], 0 off the mask
    # k3 = e^x - 1 - x, x = log(pi_old / pi_rollout) (Schulman 2020), through expm1 in float64: in
    # float32, e^x - 1 - x cancels to 0 for the mismatches of a fp32 rollout (|x| ~ 1e-7)
    x = log_ratio.double()
    metrics = {"kl": Metric(masked_mean(torch.expm1(x) - x, mask).to(old.dtype))}
    if mode == RolloutCorrection.none:
        return None, metrics
    if mode.startswith("seq_"):
        log_ratio = clamp_log_ratio(log_ratio.sum(-1, keepdim=True)).expand_as(old)  # [batch, T]
    ratio = torch.exp(log_ratio)
    over = ratio > threshold
    if mode == RolloutCorrection.icepop:
        over = over | (ratio < low)
    if mode.endswith("_tis"):
        weights = ratio.clamp(max=threshold)
    else:
        weights = torch.where(over, 0.0, ratio)
    weights = select_valid(weights, mask)
    frac = "frac_truncated" if mode.endswith("_tis") else "frac_masked"
    metrics |= {"weight_mean": Metric(masked_mean(weights, mask)),
                "weight_max": Metric(torch.where(valid, weights, 0.0).max(), Reduce.MAX),
                "ratio_max": Metric(torch.where(valid, ratio, 0.0).max(), Reduce.MAX),
                frac: Metric(masked_mean(over.to(old.dtype), mask))}
    return weights, metrics
