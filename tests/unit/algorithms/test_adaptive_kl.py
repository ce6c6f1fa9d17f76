"""Adaptive KL (algorithm.kl_target, Ziegler et al. 2019 §2.2) in the driver: the coefficient
applied to each step's KL-in-reward, then moved by beta *= 1 + clip(KL / target - 1, -0.2, 0.2) x
rows / horizon, with KL the rows' mean of each row's mean per-token estimate; against float64
arithmetic written from the paper, on random log-probs with masks and padding."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.config.schema import AlgorithmConfig
from megarl.trainer.steps import KLCoefficient, advantages


class Rows:
    def __init__(self, seed, rows=6, width=7):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, width + 1, (rows,), generator=gen)
        self.loss_mask = (torch.arange(width)[None] < lengths[:, None]).float()
        self.ref_log_probs = -torch.rand(rows, width, generator=gen) * 3
        self.old_log_probs = self.ref_log_probs + 0.3 * torch.randn(rows, width, generator=gen)
        self.old_log_probs = torch.where(self.loss_mask.bool(), self.old_log_probs, torch.tensor(float("nan")))

    def __len__(self):
        return len(self.loss_mask)


def k3(logp, ref):  # Schulman's k3 of KL(pi || ref) on pi's samples: e^(ref - logp) - (ref - logp) - 1
    return math.exp(ref - logp) - (ref - logp) - 1


@pytest.mark.parametrize("target", [0.01, 0.05, 1.0])
def test_the_coefficient_follows_ziegler_et_al(target):
    algo = AlgorithmConfig(name="grpo", kl_coef=0.1, kl_in_reward=True, kl_target=target, kl_horizon=40.0,
                           kl_estimator="k3")
    kl, beta = KLCoefficient(algo), 0.1
    for step in range(4):
        batch = Rows(step)
        means = []
        for i in range(len(batch)):
            n = int(batch.loss_mask[i].sum())
            means.append(sum(k3(float(batch.old_log_probs[i, t]), float(batch.ref_log_probs[i, t])) for t in range(n)) / n)
        current = sum(means) / len(means)
        metrics = kl.observe(batch)
        assert metrics["reward/kl_coef"] == pytest.approx(beta, rel=1e-6)  # float32 KL estimates
        assert metrics["reward/kl_mean"] == pytest.approx(current, rel=1e-5)
        beta *= 1 + min(max(current / target - 1, -0.2), 0.2) * len(batch) / 40.0
        assert kl.value == pytest.approx(beta, rel=1e-5)


def test_the_applied_coefficient_shapes_the_rewards():
    from megarl.protocol import Batch  # noqa: F401  (the columns advantages reads)

    algo = AlgorithmConfig(name="reinforce_pp", kl_coef=0.1, kl_in_reward=True, kl_target=0.01)
    batch = Rows(0)
    full = Batch.__new__(Batch)
    for name, value in (("loss_mask", batch.loss_mask), ("old_log_probs", batch.old_log_probs.nan_to_num(0.0)),
                        ("ref_log_probs", batch.ref_log_probs), ("scores", torch.ones(len(batch))),
                        ("index", torch.arange(len(batch))), ("values", None), ("baseline_scores", None)):
        object.__setattr__(full, name, value)
    for coef in (0.1, 0.37):
        out = advantages(full, algo, kl_coef=coef)
        kl = torch.exp(batch.ref_log_probs - full.old_log_probs) - (batch.ref_log_probs - full.old_log_probs) - 1
        want = (coef * kl * batch.loss_mask).sum(-1)
        assert torch.allclose(out["kl_penalty"], want, rtol=1e-5, atol=1e-7)


def test_adaptive_kl_needs_the_kl_in_the_reward():
    from megarl.algorithms.presets import resolve

    with pytest.raises(ValueError, match=r"algorithm.kl_target=0.01 \(adaptive KL\) .* set algorithm.kl_in_reward=true"):
        resolve(AlgorithmConfig(name="grpo", kl_coef=0.1, kl_target=0.01))
    with pytest.raises(ValueError, match=r"algorithm.kl_coef > 0"):
        resolve(AlgorithmConfig(name="grpo", kl_coef=0.0, kl_in_reward=True, kl_target=0.01))
