"""Policy, value, entropy and KL losses, and the token/sequence aggregation they share.

Every loss reduces a ``[batch, T]`` loss matrix with :func:`aggregate`. Given the global
denominators (valid tokens / sequences of the whole optimizer step, summed over micro-batches
and data-parallel ranks, see :func:`loss_denominators`), the losses are additive: summing them
over any split of the step's batch gives the loss, and the gradient, of the whole batch.

Numerical safety: every input is selected at the valid tokens (``torch.where``) before any
arithmetic, so an inf or NaN at a padding position reaches neither a loss nor a gradient
(multiplying by the mask would give inf * 0 = NaN, and exp's backward 0 * exp(NaN) = NaN); every
log-ratio is clamped to +-``kl.LOG_RATIO_BOUND`` (20) before it is exponentiated.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from megarl.algorithms.kl import KL_ESTIMATORS, clamp_log_ratio, k3
from megarl.algorithms.masked import masked_mean, select_valid
from megarl.config.schema import AggMode
from megarl.registry import Registry

Count = Union[int, float, Tensor]
Metrics = Dict[str, Tensor]  # 0-d, detached, local to this micro-batch: no host sync here
PolicyLoss = Callable[..., Tuple[Tensor, Metrics]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

AGG_MODES = tuple(AggMode)  # algorithm.agg_mode


def loss_denominators(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Local (valid tokens, sequences with at least one valid token).

    Sum these over the step's micro-batches and DP ranks to get ``global_tokens`` and
    ``global_seqs``; fully masked rows (padding samples) count as no sequence.
    """
    lengths = mask.sum(-1)  # [batch]
    return lengths.sum(), (lengths > 0).sum()


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    max_len: Optional[int] = None,
) -> Tensor:
    """Reduce ``loss_mat`` ``[batch, T]`` over its valid tokens to a scalar.

    - ``token-mean``: sum over tokens / tokens (DAPO, Yu et al. 2025 §3.3, token-level loss).
    - ``seq-mean-token-sum``: per-sequence sum, summed over sequences / sequences.
    - ``seq-mean-token-mean``: per-sequence mean, summed / sequences (GRPO, Shao et al. 2024 eq. 3).
    - ``seq-mean-token-sum-norm``: per-sequence sum / ``max_len``, summed / sequences (Dr. GRPO,
      Liu et al. 2025). ``max_len`` is the generation budget, a constant: the local padded length
      differs between micro-batches and would break additivity.

    The denominators are ``global_tokens`` / ``global_seqs`` when given, else local counts.
    Masked positions are selected away, so whatever they hold (inf, NaN) changes nothing.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {mode!r}; available: {', '.join(AGG_MODES)}")
    masked = select_valid(loss_mat, mask)  # [batch, T]
    mask = mask.to(loss_mat.dtype)
    local_tokens, local_seqs = loss_denominators(mask)
    if mode == AggMode.token_mean:
        tokens = local_tokens.clamp_min(1) if global_tokens is None else global_tokens
        return masked.sum() / tokens
    if mode == AggMode.seq_mean_token_sum:
        per_seq = masked.sum(-1)  # [batch]
    elif mode == AggMode.seq_mean_token_mean:
        per_seq = masked.sum(-1) / mask.sum(-1).clamp_min(1)
    else:
        if max_len is None:
            raise ValueError("agg_mode 'seq-mean-token-sum-norm' needs max_len, the generation budget")
        per_seq = masked.sum(-1) / max_len
    seqs = local_seqs.clamp_min(1) if global_seqs is None else global_seqs
    return per_seq.sum() / seqs


def _weighted(loss_mat: Tensor, weights: Optional[Tensor], mask: Tensor) -> Tensor:
    """``loss_mat`` times per-token ``weights`` (detached, selected at the mask): a weight of 0
    removes a token's gradient exactly; the aggregation's denominators do not change."""
    if weights is None:
        return loss_mat
    return loss_mat * select_valid(weights.detach(), mask)


def _ratio_metrics(
    logp: Tensor, old_logp: Tensor, ratio: Tensor, clipped: Tensor, mask: Tensor
) -> Metrics:
    """Token means over the micro-batch; approx_kl is k3 for KL(old || new) on tokens from old."""
    with torch.no_grad():
        return {
            "clip_frac": masked_mean(clipped.to(logp.dtype), mask),
            "approx_kl": masked_mean(k3(old_logp, logp), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }


@POLICY_LOSSES.register("ppo")
def ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg_mode: AggMode = AggMode.token_mean,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    max_len: Optional[int] = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: Optional[float] = None,
    weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), per token:
    max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = pi/pi_old.

    ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al. 2025, §3.1). ``dual_clip_c`` caps the
    loss of negative-advantage tokens at -c A, so a huge ratio cannot blow it up (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games", eq. 5); c must exceed 1. The log-ratio is clamped
    to +-LOG_RATIO_BOUND: a token beyond it has ratio e^20 and no gradient (it is clipped anyway).
    ``weights`` ``[batch, T]`` (e.g. rollout correction's importance weights) multiply each
    token's loss, as constants; the denominators stay those of the mask.
    Metrics: clip_frac (tokens whose gradient the clip removed), dual_clip_frac, approx_kl,
    ratio_mean.
    """
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1 (typically 3); None disables it")
    logp, old_logp, advantages = (select_valid(x, mask) for x in (logp, old_logp, advantages))
    ratio = torch.exp(clamp_log_ratio(logp - old_logp))  # [batch, T]
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss_mat, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        dual_clipped = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_clipped, cap, loss_mat)
    loss_mat = _weighted(loss_mat, weights, mask)
    loss = aggregate(
        loss_mat, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len
    )
    metrics = _ratio_metrics(logp, old_logp, ratio, clipped > unclipped, mask)
    metrics["dual_clip_frac"] = masked_mean(dual_clipped.to(logp.dtype), mask)
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg_mode: AggMode = AggMode.seq_mean_token_mean,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    max_len: Optional[int] = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip_c: Optional[float] = None,
    weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", §4.1 and the GSPO-token
    form of §4.3): the sequence ratio s_i = exp(mean_t (logp - old_logp)) is clipped to
    [1 - clip_low, 1 + clip_high] (the paper's 3e-4 / 4e-4 by default).

    Per token, s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]): its value is s_i and its gradient flows
    through each token's log-prob. With a per-sequence advantage (constant over the sequence's
    tokens) and ``seq-mean-token-mean`` this is exactly GSPO's gradient; token-varying advantages
    give GSPO-token. Dual clip is not defined for sequence ratios. The sequence log-ratio is
    clamped to +-LOG_RATIO_BOUND. ``weights`` multiply each token's loss, as in :func:`ppo_loss`.
    """
    if dual_clip_c is not None:
        raise ValueError("gspo has no dual clip; set dual_clip_c=None")
    logp, old_logp, advantages = (select_valid(x, mask) for x in (logp, old_logp, advantages))
    lengths = mask.to(logp.dtype).sum(-1).clamp_min(1)  # [batch]
    seq_log_ratio = clamp_log_ratio((logp - old_logp).sum(-1) / lengths)  # [batch]
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + logp - logp.detach())  # [batch, T], value s_i
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss_mat = _weighted(torch.maximum(unclipped, clipped), weights, mask)
    loss = aggregate(
        loss_mat, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len
    )
    return loss, _ratio_metrics(logp, old_logp, ratio, clipped > unclipped, mask)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    agg_mode: str,
    *,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    max_len: Optional[int] = None,
) -> Tensor:
    """Aggregated policy entropy ``[batch, T]`` -> scalar; the trainer subtracts coef * this from
    the loss (Schulman et al. 2017, eq. 9)."""
    return aggregate(
        entropy, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len
    )


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    estimator_name: str = "k3",
    agg_mode: AggMode = AggMode.token_mean,
    *,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    max_len: Optional[int] = None,
) -> Tensor:
    """KL to the reference as a loss term rather than a reward penalty (GRPO, Shao et al. 2024,
    eq. 3-4, with k3); the trainer adds coef * this."""
    estimator = KL_ESTIMATORS.get(estimator_name)
    kl = estimator(select_valid(logp, mask), select_valid(ref_logp, mask))  # [batch, T]
    return aggregate(
        kl, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len
    )


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float,
    agg_mode: AggMode = AggMode.token_mean,
    *,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    max_len: Optional[int] = None,
) -> Tuple[Tensor, Metrics]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old,
    -clip_range, clip_range) (OpenAI baselines PPO2; Engstrom et al. 2020, "Implementation
    Matters", §3 value clipping). Metrics: clip_frac (tokens where the clipped error is used)."""
    values, old_values, returns = (select_valid(x, mask) for x in (values, old_values, returns))
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    error = (values - returns) ** 2  # [batch, T]
    error_clipped = (values_clipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(error, error_clipped)
    loss = aggregate(
        loss_mat, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len
    )
    with torch.no_grad():
        clip_frac = masked_mean((error_clipped > error).to(values.dtype), mask)
    return loss, {"clip_frac": clip_frac}
