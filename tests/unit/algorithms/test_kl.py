"""KL estimators, reward shaping and KL coefficient controllers against hand arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty_rewards,
)


def test_estimator_values():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref_logp = torch.tensor([-2.0, -1.0, -0.5])
    # log(pi/ref) = 1, -1, 0
    k1, k2, k3 = (KL_ESTIMATORS.get(name)(logp, ref_logp) for name in ("k1", "k2", "k3"))
    torch.testing.assert_close(k1, torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(k2, torch.tensor([0.5, 0.5, 0.0]))
    # k3 = e^(-x) + x - 1 with x = log(pi/ref)
    torch.testing.assert_close(k3, torch.tensor([math.exp(-1.0), math.e - 2.0, 0.0]))


def test_k3_is_nonnegative():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 32, generator=gen) * 3
    ref_logp = torch.randn(64, 32, generator=gen) * 3
    assert (KL_ESTIMATORS.get("k3")(logp, ref_logp) >= 0).all()


def test_kl_penalty_rewards_masks_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    kl = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    shaped = kl_penalty_rewards(rewards, kl, 0.1, mask)
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, 0.1, 0.8], [-0.1, 1.9, 0.0]]))


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 0.5, clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    before = ctl.value
    ctl.update(current_kl=6.6, n_steps=500)  # error 0.1, inside the clip
    assert ctl.value == pytest.approx(before * (1 + 0.1 * 500 / 10000))
    before = ctl.value
    ctl.update(current_kl=0.0, n_steps=1000)  # error -1, clipped to -0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 1000 / 10000))
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=1)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=10)
    assert ctl.value == 0.05
