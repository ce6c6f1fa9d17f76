"""VAPO's pieces (Yue et al. 2025, arXiv:2504.05118) against float64 references written from the
paper, plain Python loops over each response's own tokens, on random inputs with padding and masks:
decoupled GAE (§4.2: the critic's targets at lambda_critic, the policy's advantages at another
lambda), length-adaptive GAE (eq. 7: lambda = 1 - 1/(alpha l)) and the positive-example LM loss
(eq. 9). Also the preset's defaults and the refusals of knobs without a critic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megarl.algorithms.presets import resolve
from megarl.config.schema import AggMode, AlgorithmConfig
from megarl.roles.actor import Actor, ActorLossConfig
from megarl.trainer.steps import positive_nll_weights


def random_batch(rows=6, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        start = int(torch.randint(0, 3, (1,), generator=g))  # a prompt's tail before the response
        length = int(torch.randint(1, width - start + 1, (1,), generator=g))
        mask[i, start:start + length] = 1
        if length > 3:  # an observation token inside the response (multi-turn): not a step
            mask[i, start + 1] = 0
    rewards = torch.randn(rows, width, generator=g, dtype=torch.float64) * mask
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    values[mask == 0] = float("nan")  # whatever a padding position holds reaches nothing
    return mask, rewards, values


def reference_gae(rewards, values, mask, gamma, lam_of_row):
    """Schulman et al. 2016 eq. 16 over each row's valid steps only, in Python floats."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[i, t]]
        lam = lam_of_row(len(steps))
        adv_next, v_next = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[i, t]) + gamma * v_next - float(values[i, t])
            adv_next = delta + gamma * lam * adv_next
            v_next = float(values[i, t])
            out[i, t] = adv_next
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_decoupled_and_length_adaptive_gae(gamma):
    mask, rewards, values = random_batch()
    alpha, lam_critic = 0.3, 1.0
    adv, returns = ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(
        response_mask=mask, token_rewards=rewards, values=values, gamma=gamma, lam=0.95,
        lam_critic=lam_critic, lam_length_alpha=alpha))
    policy = reference_gae(rewards, values, mask, gamma, lambda l: min(1.0, max(0.0, 1 - 1 / (alpha * l))))
    critic = reference_gae(rewards, values, mask, gamma, lambda l: lam_critic)
    valid = mask.bool()
    torch.testing.assert_close(adv[valid], policy[valid], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns[valid], (critic + values)[valid], rtol=1e-12, atol=1e-12)
    assert (adv[~valid] == 0).all() and (returns[~valid] == 0).all()
    # the length-adaptive lambda differs between rows, and clamps short rows to 0 (1 - 1/(0.3 l) < 0 for l < 4)
    lengths = mask.sum(-1)
    assert lengths.min() < 4 < lengths.max()
    # lambda_critic = 1 with gamma = 1: the targets are the Monte-Carlo returns, sum of the rewards ahead
    if gamma == 1.0:
        ahead = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
        torch.testing.assert_close(returns[valid], ahead[valid], rtol=1e-12, atol=1e-12)


def test_without_the_knobs_gae_is_one_lambda():
    mask, rewards, values = random_batch(seed=1)
    adv, returns = ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(
        response_mask=mask, token_rewards=rewards, values=values, gamma=1.0, lam=0.9))
    ref = reference_gae(rewards, values, mask, 1.0, lambda l: 0.9)
    valid = mask.bool()
    torch.testing.assert_close(adv[valid], ref[valid], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns[valid], (ref + values)[valid], rtol=1e-12, atol=1e-12)


def actor(loss: ActorLossConfig) -> Actor:
    """The actor's loss without an engine (the loss reads only its config)."""
    out = Actor.__new__(Actor)
    out.cfg = loss
    return out


def reference_positive_nll(logp, mask, scores):
    """Eq. 9: -1/sum_{o in T}|o| * sum_{o in T} sum_t log p, T the samples with reward > 0."""
    total, tokens = 0.0, 0
    for i in range(logp.shape[0]):
        if scores[i] > 0:
            for t in range(logp.shape[1]):
                if mask[i, t]:
                    total -= float(logp[i, t])
                    tokens += 1
    return total / tokens


@pytest.mark.parametrize("agg_mode", [AggMode.token_mean, AggMode.seq_mean_token_mean])
def test_positive_nll_in_the_actor_loss(agg_mode):
    """The actor's loss with positive_nll_coef is the policy loss plus coef x eq. 9, once the
    engine divides the summed loss by the step's count (tokens, or sequences), as it does."""
    mask, _, _ = random_batch(seed=2)
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    logp[mask == 0] = float("-inf")  # padding holds anything
    scores = torch.tensor([1.0, 0.0, 0.5, -1.0, 1.0, 0.0], dtype=torch.float64)
    mask = mask.double()
    weights = positive_nll_weights(scores, mask, agg_mode)
    tensors = {"loss_mask": mask, "old_log_probs": torch.where(mask.bool(), logp, 0.0),
               "advantages": torch.randn(mask.shape, generator=g, dtype=torch.float64), "nll_weights": weights}
    entropy = torch.zeros(mask.shape, dtype=torch.float64)
    coef = 0.1
    with_nll, count, metrics = actor(ActorLossConfig(agg_mode=agg_mode, positive_nll_coef=coef))._loss(
        logp, entropy, tensors)
    without, count0, _ = actor(ActorLossConfig(agg_mode=agg_mode))._loss(logp, entropy, tensors)
    assert count == count0
    expected = reference_positive_nll(logp, mask, scores)
    assert float((with_nll - without) / count) == pytest.approx(coef * expected, rel=1e-12)
    assert float(metrics["positive_nll"].value / count) == pytest.approx(expected, rel=1e-12)
    # no positive sample: no term
    none = positive_nll_weights(torch.zeros(6), mask, agg_mode)
    assert (none == 0).all()


def test_vapo_preset_defaults_and_refusals():
    vapo = resolve(AlgorithmConfig(name="vapo"))
    assert (vapo.lam_critic, vapo.lam_length_alpha, vapo.positive_nll_coef) == (1.0, 0.05, 0.1)
    ppo = resolve(AlgorithmConfig(name="ppo", lam=0.9))
    assert (ppo.lam_critic, ppo.lam_length_alpha, ppo.positive_nll_coef) == (0.9, 0.0, 0.0)
    # each piece alone, on PPO
    alone = resolve(AlgorithmConfig(name="ppo", lam_critic=1.0, lam_length_alpha=0.05))
    assert (alone.lam_critic, alone.lam_length_alpha) == (1.0, 0.05)
    assert resolve(AlgorithmConfig(name="grpo", positive_nll_coef=0.1)).positive_nll_coef == 0.1
    assert resolve(dataclasses.replace(vapo, name="vapo", lam_length_alpha=0.0)).lam_length_alpha == 0.0
    for knob, value in (("lam_critic", 1.0), ("lam_length_alpha", 0.05)):
        with pytest.raises(ValueError, match=f"algorithm.{knob}=.*grpo"):
            resolve(AlgorithmConfig(name="grpo", **{knob: value}))
