"""The decoupled PPO loss (Hilton et al. 2022, "Batch size-invariance for policy optimization",
as AReaL trains asynchronously) against a float64 reference written from its formula.

Three policies: the behaviour policy mu that sampled each token (the rollout's per-token
log-probs: with partial rollouts, tokens of one response come from different versions), the
proximal policy pi_prox (the actor's log-probs before this step's update: ``old_log_probs``), and
the policy being trained pi. Per token

    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi / pi_prox,
    w_t = pi_prox / mu, set to 0 above the cap C (AReaL's behav_imp_weight_cap),

averaged over every response token (masked ones count in the denominator). In megarl this is
``algorithm.policy_loss=ppo`` with ``algorithm.rollout_correction=token_mis`` and
``rollout_correction_threshold=C``; ``token_tis`` truncates w_t at C instead of masking it.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.config.schema import AggMode, RolloutCorrection
from megarl.roles.actor import Actor, ActorLossConfig


def actor(loss: ActorLossConfig) -> Actor:
    out = Actor.__new__(Actor)  # the loss reads only its config
    out.cfg = loss
    return out


def reference(logp, prox, behav, adv, mask, eps_low, eps_high, cap, truncate):
    """The formula token by token in Python floats; the loss is a sum of autograd scalars."""
    total, tokens = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            tokens += 1
            r = torch.exp(logp[i, t] - float(prox[i, t]))
            a = float(adv[i, t])
            surrogate = torch.maximum(-a * r, -a * r.clamp(1 - eps_low, 1 + eps_high))
            w = math.exp(float(prox[i, t]) - float(behav[i, t]))
            w = min(w, cap) if truncate else (w if w <= cap else 0.0)
            total = total + w * surrogate
    return total / tokens


@pytest.mark.parametrize("mode", [RolloutCorrection.token_mis, RolloutCorrection.token_tis])
def test_decoupled_ppo_loss_equals_the_formula(mode):
    g = torch.Generator().manual_seed(7)
    rows, width = 5, 11
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for i, (start, length) in enumerate([(0, 11), (2, 6), (1, 1), (3, 8), (0, 4)]):
        mask[i, start:start + length] = 1
    # behaviour log-probs from two versions within a row (a sync mid-response) and a proximal
    # policy that moved: some weights pi_prox / mu land above the cap
    prox = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    behav = prox + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.6
    logp = (prox + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(rows, width, generator=g, dtype=torch.float64)
    cap = 1.5
    weights = torch.where(mask.bool(), (prox - behav).exp(), 0)
    assert ((weights > cap) & mask.bool()).any() and ((weights < cap) & mask.bool()).any()
    padded = lambda x: torch.where(mask.bool(), x, float("nan"))  # noqa: E731 - padding holds anything
    tensors = {"loss_mask": mask, "old_log_probs": padded(prox), "rollout_log_probs": padded(behav),
               "advantages": padded(adv)}
    cfg = ActorLossConfig(agg_mode=AggMode.token_mean, clip_low=0.2, clip_high=0.28, rollout_correction=mode,
                          rollout_correction_threshold=cap)
    loss, count, metrics = actor(cfg)._loss(logp, torch.zeros_like(mask), tensors)
    loss = loss / count  # the engine divides the summed loss by the step's token count
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_()
    ref = reference(ref_logp, prox, behav, adv, mask, 0.2, 0.28, cap, truncate=mode == RolloutCorrection.token_tis)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert (grad[mask == 0] == 0).all()
    # the share of tokens whose weight was over the cap, as logged
    over = float(((weights > cap) & mask.bool()).sum() / mask.sum())
    key = "rollout_correction/frac_masked" if mode == RolloutCorrection.token_mis else "rollout_correction/frac_truncated"
    assert float(metrics[key].value / count) == pytest.approx(over, rel=1e-12)
