"""PRIME's pieces (Cui et al. 2025, arXiv:2502.01456; verl-recipe's ``prime`` defaults) against
float64 references written from their definitions, plain loops over each response's own tokens, on
random inputs with padding and groups in any order: the implicit PRM's token reward and its
cross-entropy, and the RLOO of the process and outcome rewards, summed, reverse-cumulated, whitened."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megarl.config.schema import PrmNorm
from megarl.roles.prm import implicit_process_rewards, prm_bce
from tests.unit.algorithms.test_vapo import random_batch


def test_token_rewards_and_cross_entropy():
    mask, _, _ = random_batch(seed=4)
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 4
    logp[mask == 0] = float("nan")  # padding holds anything
    labels = torch.tensor([1.0, 0.0, 0.25, 1.0, 0.0, 0.5], dtype=torch.float64)[:, None] * mask
    beta = 0.05
    q = implicit_process_rewards(logp, ref, mask, beta)
    losses, z, y, has = prm_bce(logp, ref, mask, labels, beta)
    for i in range(mask.shape[0]):
        steps = [t for t in range(mask.shape[1]) if mask[i, t]]
        assert all(q[i, t] == 0 for t in range(mask.shape[1]) if not mask[i, t])
        for t in steps:
            assert float(q[i, t]) == pytest.approx(beta * (float(logp[i, t]) - float(ref[i, t])), rel=1e-12)
        zi = beta * sum(float(logp[i, t]) - float(ref[i, t]) for t in steps)
        yi = float(labels[i, steps[0]])
        p = 1 / (1 + math.exp(-zi))
        assert float(z[i]) == pytest.approx(zi, rel=1e-12)
        assert float(losses[i]) == pytest.approx(-(yi * math.log(p) + (1 - yi) * math.log(1 - p)), rel=1e-10)
    assert has.all()


def reference_batch_norm(q, mask):
    """verl-recipe prime_norm=batch_norm: every token reward over (max over the batch's rows i and
    response tokens t of |sum_{s >= t} q_is|) + 1e-6."""
    rows, width = mask.shape
    steps = [[t for t in range(width) if mask[i, t]] for i in range(rows)]
    largest = max(abs(sum(float(q[i, s]) for s in steps[i] if s >= t)) for i in range(rows) for t in steps[i])
    out = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        for t in steps[i]:
            out[i, t] = float(q[i, t]) / (largest + 1e-6)
    return out


def reference_prime(q, scores, mask, index, cp, co):
    """verl-recipe prime: per group of n, r'_t = r_t n/(n-1) - sum_j mean_j/(n-1) over the valid
    tokens (process) and over the last token (outcome); cp and co weights; G_t = sum_{s>=t}; whiten."""
    rows, width = mask.shape
    steps = [[t for t in range(width) if mask[i, t]] for i in range(rows)]
    total = [[0.0] * width for _ in range(rows)]
    for coef, reward_of, positions in ((cp, lambda i, t: float(q[i, t]), lambda i: steps[i]),
                                       (co, lambda i, t: float(scores[i]), lambda i: steps[i][-1:])):
        means = {i: sum(reward_of(i, t) for t in positions(i)) / len(positions(i)) for i in range(rows)}
        for i in range(rows):
            group = [j for j in range(rows) if index[j] == index[i]]
            n, base = len(group), sum(means[j] for j in group)
            for t in positions(i):
                total[i][t] += coef * (reward_of(i, t) * n / (n - 1) - base / (n - 1))
    returns = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        acc = 0.0
        for t in reversed(steps[i]):
            acc += total[i][t]
            returns[i, t] = acc
    vals = [float(returns[i, t]) for i in range(rows) for t in steps[i]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)  # population variance, as megarl whitens everywhere
    adv = torch.zeros_like(returns)
    for i in range(rows):
        for t in steps[i]:
            adv[i, t] = (returns[i, t] - mean) / math.sqrt(var + 1e-8)
    return adv, returns


@pytest.mark.parametrize("norm", list(PrmNorm))
def test_rloo_of_process_and_outcome_rewards(norm):
    """With batch_norm (the default) the token rewards are first scaled by the batch's largest
    |reverse cumulative sum|; with none they enter the RLOO as they are."""
    mask, q, _ = random_batch(rows=6, seed=6)
    q = q * 40  # log-ratios of a PRM far from its reference: batch_norm's divisor is well above 1
    q[mask == 0] = float("nan")  # padding holds anything
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0], dtype=torch.float64)
    index = torch.tensor([7, 3, 7, 3, 7, 3])  # two groups of three, interleaved
    adv, returns = ADVANTAGE_ESTIMATORS.get("prime")(AdvantageInputs(
        response_mask=mask, process_rewards=q, scores=scores, index=index, process_coef=5.0, outcome_coef=5.0,
        process_norm=norm))
    scaled = reference_batch_norm(q, mask) if norm == PrmNorm.batch_norm else q
    ref_adv, ref_returns = reference_prime(scaled, scores, mask, index, 5.0, 5.0)
    valid = mask.bool()
    torch.testing.assert_close(returns[valid], ref_returns[valid], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv[valid], ref_adv[valid], rtol=1e-10, atol=1e-10)
    assert (returns[~valid] == 0).all() and (adv[~valid] == 0).all()


def test_pair_accuracy_as_verl_recipes_dpo_acc():
    """prm/pair_acc against a loop over each group's pairs: the |y_i - y_j|-weighted share of the
    pairs with different labels that the sequence scores order alike (a tie a half), averaged over
    the groups having such a pair; a group of equal labels is left out; none at all: None."""
    from megarl.algorithms.advantages import prm_pair_accuracy

    z = torch.tensor([0.3, -0.1, 0.2, 0.2, 0.0, -1.0, 0.0, 0.4, 0.1], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 0.25, 0.5, 0.5, 0.0, 0.75, 0.75, 0.75], dtype=torch.float64)
    index = torch.tensor([4, 4, 9, 9, 4, 9, 2, 2, 2])  # group 2: equal labels, no pair counts
    per_group = []
    for g in (4, 9, 2):
        rows = [i for i in range(len(z)) if index[i] == g]
        num = den = 0.0
        for a, i in enumerate(rows):
            for j in rows[a + 1:]:
                w = abs(float(y[i] - y[j]))
                if w:
                    dz = float(z[i] - z[j])
                    num += w * (0.5 if dz == 0 else float(dz * float(y[i] - y[j]) > 0))
                    den += w
        if den:
            per_group.append(num / den)
    assert per_group == [1.0, 0.875]  # the mean over groups, not over pairs (0.958)
    assert prm_pair_accuracy(z, y, index) == pytest.approx(sum(per_group) / 2, rel=1e-12)
    assert prm_pair_accuracy(z, torch.zeros_like(y), index) is None
    assert prm_pair_accuracy(torch.zeros_like(z), y, index) == 0.5  # the PRM at its start
