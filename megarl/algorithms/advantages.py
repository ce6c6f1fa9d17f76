"""Advantage estimators: token rewards, outcome scores and values in, ``(advantages, returns)`` out.

Every estimator takes one :class:`AdvantageInputs` and returns two ``[batch, response_len]``
tensors that are zero at masked positions. Critic-free estimators return ``returns = advantages``
before any whitening (there is no value head to regress onto them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from megarl.algorithms.masked import masked_whiten
from megarl.config.schema import PrmNorm
from megarl.registry import Registry

AdvantageEstimator = Callable[["AdvantageInputs"], Tuple[Tensor, Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may need; each estimator says which fields it reads."""

    response_mask: Optional[Tensor] = None  # [batch, T], 1 = real response token
    token_rewards: Optional[Tensor] = None  # [batch, T], e.g. score at the last token minus KL
    scores: Optional[Tensor] = None  # [batch], outcome reward of each sample
    values: Optional[Tensor] = None  # [batch, T], critic values V(s_t)
    index: Optional[Tensor] = None  # [batch] int64, group (prompt) id of each sample
    baseline_scores: Optional[Tensor] = None  # [batch], reward of the greedy sample (ReMax)
    process_rewards: Optional[Tensor] = None  # [batch, T], PRIME's implicit PRM token rewards
    process_coef: float = 5.0  # PRIME: weight of the process rewards' RLOO
    outcome_coef: float = 5.0  # PRIME: weight of the outcome scores' RLOO
    process_norm: PrmNorm = PrmNorm.batch_norm  # PRIME: batch_norm bounds the process rewards' returns to [-1, 1]
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda (of the policy's advantages)
    lam_critic: Optional[float] = None  # GAE: lambda of the value targets (returns); None = lam (VAPO: 1.0)
    lam_length_alpha: float = 0.0  # GAE: > 0 = length-adaptive policy lambda 1 - 1/(alpha * l) (VAPO: 0.05)
    norm_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    whiten: bool = False  # GAE: whiten advantages over the batch's valid tokens
    eps: float = 1e-6  # GRPO: added to the group std

    def need(self, field: str, estimator: str) -> Tensor:
        """The field ``estimator`` cannot do without; a ValueError names it when unset."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
        return value


def _group_stats(scores: Tensor, index: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Per row (``[batch]`` each): its group's size, score minus group mean, and the group's sum of
    squared deviations."""
    _, group = torch.unique(index, return_inverse=True)  # ids -> 0..G-1, any order, any gaps
    num_groups = int(group.max()) + 1

    def group_sum(x: Tensor) -> Tensor:
        sums = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, group, x)
        return sums[group]

    # Shift by a member of the group first: a group of equal scores then centres to exactly 0.
    # Without it, 7 copies of 0.1 leave a rounding residue that 1/(std + eps) blows up to ~0.01.
    group_max = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    shifted = scores - group_max.scatter_reduce_(0, group, scores, "amax", include_self=False)[group]
    count = group_sum(torch.ones_like(scores))
    centred = shifted - group_sum(shifted) / count
    return count, centred, group_sum(centred**2)


def _per_token(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Broadcast a ``[batch]`` value over the response tokens: ``[batch, T]``, 0 where masked."""
    return seq_values[:, None] * mask.to(seq_values.dtype)


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next valid token; masked positions are skipped."""
    valid = mask.bool()
    carry = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        ret = rewards[:, t] + gamma * carry
        carry = torch.where(valid[:, t], ret, carry)
        out.append(torch.where(valid[:, t], ret, 0.0))
    return torch.stack(out[::-1], dim=1)


def _gae_advantages(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lam: Tensor) -> Tensor:
    """A_t = delta_t + gamma * lam * A_{t'} (t' the next valid token; 0 after the last), delta_t =
    r_t + gamma V_{t'} - V_t; ``lam`` [batch], one lambda per row. 0 at masked positions."""
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        out.append(torch.where(valid[:, t], adv, 0.0))
    return torch.stack(out[::-1], dim=1)  # [batch, T]


def length_adaptive_lam(mask: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE (Yue et al. 2025, arXiv:2504.05118, eq. 7): lambda_policy = 1 -
    1/(alpha * l) for a response of l tokens (its valid positions), clamped to [0, 1]; [batch]."""
    lengths = mask.to(torch.float64).sum(-1)
    return (1 - 1 / (alpha * lengths.clamp_min(1))).clamp(0, 1)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using GAE", eq. 16): A_t = sum_l (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma
    V_{t+1} - V_t, V = 0 after the last token. returns = A + V (the critic's target).

    Decoupled GAE (VAPO, Yue et al. 2025, §4.2): the returns are A + V with A computed at
    ``lam_critic`` (VAPO: 1.0, unbiased Monte-Carlo targets), the policy's advantages at ``lam``,
    or with ``lam_length_alpha`` > 0 at each row's length-adaptive lambda
    (:func:`length_adaptive_lam`).

    Masked positions are not steps of the episode: the recursion carries over them, so right
    padding (and masked tokens inside a response) neither contribute nor cut the sum. With
    ``whiten`` the advantages are whitened over the batch's valid tokens, a local statistic;
    a DP-sharded trainer must whiten with global statistics (``whiten_with_stats``) instead.
    """
    rewards = inputs.need("token_rewards", "gae")
    values = inputs.need("values", "gae")
    mask = inputs.need("response_mask", "gae")
    valid = mask.bool()
    rows = values.shape[0]
    if inputs.lam_length_alpha > 0:
        lam = length_adaptive_lam(mask, inputs.lam_length_alpha).to(values.dtype)
    else:
        lam = torch.full((rows,), inputs.lam, dtype=values.dtype, device=values.device)
    advantages = _gae_advantages(rewards, values, valid, inputs.gamma, lam)
    critic_adv = advantages
    if inputs.lam_critic is not None and not (inputs.lam_length_alpha <= 0 and inputs.lam_critic == inputs.lam):
        lam_critic = torch.full((rows,), inputs.lam_critic, dtype=values.dtype, device=values.device)
        critic_adv = _gae_advantages(rewards, values, valid, inputs.gamma, lam_critic)
    returns = torch.where(valid, critic_adv + values, 0.0)
    if inputs.whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """GRPO outcome supervision (Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i - mean(r_group))
    / (std(r_group) + eps) on every response token.

    std is the unbiased (Bessel-corrected) sample std, as ``torch.std`` in verl and TRL. A group
    of size 1 has no baseline and gets advantage 0; a group of equal rewards gets 0, not NaN.
    ``norm_by_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    the Dr. GRPO objective), which also drops the 1/|o_i| length normalisation: that half is the
    loss aggregation ``seq-mean-token-sum-norm``, not this function.
    """
    scores = inputs.need("scores", "grpo")
    index = inputs.need("index", "grpo")
    mask = inputs.need("response_mask", "grpo")
    count, centred, sq_dev = _group_stats(scores, index)
    if inputs.norm_by_std:
        std = torch.sqrt(sq_dev / (count - 1).clamp_min(1))
        centred = centred / (std + inputs.eps)
    advantages = _per_token(torch.where(count > 1, centred, 0.0), mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics", the RLOO estimator, after
    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"):
    A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r_group)). Groups of size 1: 0.
    """
    scores = inputs.need("scores", "rloo")
    index = inputs.need("index", "rloo")
    mask = inputs.need("response_mask", "rloo")
    count, centred, _ = _group_stats(scores, index)
    loo = centred * count / (count - 1).clamp_min(1)
    advantages = _per_token(torch.where(count > 1, loo, 0.0), mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262, the k >= 1 variant): returns
    G_t = sum_{s>=t} gamma^(s-t) r_s over the token rewards (outcome score at the last token, the
    per-token KL penalty already folded in by the caller with ``kl_penalty_rewards``); advantages
    = G whitened over the batch's valid tokens ("global" normalisation; local statistics, see
    ``masked_whiten``). returns = G.
    """
    rewards = inputs.need("token_rewards", "reinforce_pp")
    mask = inputs.need("response_mask", "reinforce_pp")
    returns = _discounted_returns(rewards, mask, inputs.gamma)
    return masked_whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ w/ baseline (Hu et al. 2025, arXiv:2501.03262, the k > 1 variant): subtract the
    group mean of the outcome score, broadcast over tokens, then whiten over the batch's valid
    tokens (token-weighted statistics, local to the batch). returns = the centred scores.
    """
    scores = inputs.need("scores", "reinforce_pp_baseline")
    index = inputs.need("index", "reinforce_pp_baseline")
    mask = inputs.need("response_mask", "reinforce_pp_baseline")
    _, centred, _ = _group_stats(scores, index)
    returns = _per_token(centred, mask)
    return masked_whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, "ReMax", Algorithm 1): A_i = r(x, y_i) - r(x, y_greedy), the
    greedy response's reward as the baseline, on every response token.
    """
    scores = inputs.need("scores", "remax")
    baseline = inputs.need("baseline_scores", "remax")
    mask = inputs.need("response_mask", "remax")
    advantages = _per_token(scores - baseline, mask)
    return advantages, advantages


def _group_rloo(rewards: Tensor, valid: Tensor, index: Tensor) -> Tensor:
    """verl-recipe ``prime``'s leave-one-out on token rewards: each row's mean over its ``valid``
    tokens m_i, and within its group of n rows r'_t = r_t * n/(n-1) - sum_j m_j/(n-1) on the valid
    tokens (a row of one valid token, the outcome's: r_i - mean_{j != i} r_j, RLOO). 0 elsewhere."""
    _, group = torch.unique(index, return_inverse=True)
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group, torch.ones_like(rewards[:, 0]))[group]  # [batch], n of the row's group
    row_mean = torch.where(valid, rewards, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
    means_sum = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group, row_mean)[group]
    n = count.clamp_min(2)[:, None]  # a group of one has no baseline: refused by the preset (min_group 2)
    return torch.where(valid, rewards * n / (n - 1) - means_sum[:, None] / (n - 1), 0.0)


def batch_norm_process_rewards(process: Tensor, mask: Tensor) -> Tensor:
    """verl-recipe ``prime``'s ``prime_norm: batch_norm``: the token rewards (0 off ``mask``) divided
    by the largest |sum_{s >= t} r_s| over the batch's response tokens, + 1e-6, so that every
    process return lies in [-1, 1] however far the PRM's log-ratios have drifted. Over the whole
    step's batch (verl: over each data-parallel rank's share)."""
    process = torch.where(mask.bool(), process, 0.0)
    reverse_cumsum = process.flip(-1).cumsum(-1).flip(-1)
    return process / (reverse_cumsum.abs().max() + 1e-6)


@ADVANTAGE_ESTIMATORS.register("prime")
def prime(inputs: AdvantageInputs) -> Tuple[Tensor, Tensor]:
    """PRIME (Cui et al. 2025, arXiv:2502.01456, §3.3, as verl-recipe's ``prime``): the implicit
    PRM's token rewards scaled by ``process_norm`` (batch_norm: :func:`batch_norm_process_rewards`),
    then RLOO applied separately to them and to the outcome score (on each response's
    last token), weighted ``process_coef`` and ``outcome_coef`` (5 and 5), summed; returns G_t =
    sum_{s >= t} of that reward (gamma 1, the reverse cumulative sum), advantages = G whitened over
    the batch's valid tokens (local statistics, see ``masked_whiten``)."""
    process = inputs.need("process_rewards", "prime")
    scores = inputs.need("scores", "prime")
    index = inputs.need("index", "prime")
    mask = inputs.need("response_mask", "prime")
    valid = mask.bool()
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & valid
    outcome = torch.where(last, scores[:, None].to(process.dtype), 0.0)
    if inputs.process_norm == PrmNorm.batch_norm:
        process = batch_norm_process_rewards(process, mask)
    rewards = (inputs.process_coef * _group_rloo(process, valid, index)
               + inputs.outcome_coef * _group_rloo(outcome, last, index))
    returns = _discounted_returns(rewards, mask, 1.0)
    return masked_whiten(returns, mask), returns


def prm_pair_accuracy(z: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> Optional[float]:
    """How often the PRM orders a prompt's responses as the verifier does (verl-recipe prime's
    ``dpo_acc``): within each group (``index``), over the pairs whose labels differ, the share
    weighted by |y_i - y_j| where z_i - z_j has the sign of y_i - y_j (a tie counts a half: a PRM
    that scores all alike, as at the start, is at chance, 0.5); the mean
    over the groups with such a pair (verl counts the others as 0.5), None if there is none.
    ``z`` [rows]: the sequence scores, ``labels`` [rows]."""
    dy = labels[:, None] - labels[None, :]
    dz = z[:, None] - z[None, :]
    pair = (index[:, None] == index[None, :]) & torch.ones_like(dy, dtype=torch.bool).triu(1) & (dy != 0)
    weight = torch.where(pair, dy.abs(), 0.0)
    right = weight * torch.where(dz == 0, 0.5, ((dz > 0) == (dy > 0)).to(weight.dtype))
    _, group = torch.unique(index, return_inverse=True)
    groups = int(group.max()) + 1
    num = torch.zeros(groups, dtype=weight.dtype).index_add_(0, group, right.sum(-1))
    den = torch.zeros(groups, dtype=weight.dtype).index_add_(0, group, weight.sum(-1))
    informative = den > 0
    return float((num[informative] / den[informative]).mean()) if informative.any() else None
