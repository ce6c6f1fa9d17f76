"""Contract every registered advantage estimator, policy loss and KL estimator must pass.

A new registry entry is covered automatically: it runs on a random batch with right padding,
size-1 and equal-reward groups, and all inputs filled in.
"""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, AdvantageInputs

BATCH, T = 10, 7


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 3, 5, 7, 2, 6, 4, 7, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [batch, T] bool
    index = torch.tensor([5, 5, 5, 2, 2, 9, 0, 0, 0, 0])  # group 9 has one sample
    scores = torch.rand(BATCH, generator=gen)
    scores[3:5] = 0.5  # group 2: equal rewards
    token_rewards = torch.zeros(BATCH, T)
    token_rewards[torch.arange(BATCH), lengths - 1] = scores
    token_rewards = token_rewards - 0.01 * torch.rand(BATCH, T, generator=gen)  # a KL penalty
    return dict(
        response_mask=mask, token_rewards=token_rewards, scores=scores, index=index,
        values=torch.randn(BATCH, T, generator=gen), baseline_scores=torch.rand(BATCH, generator=gen),
        process_rewards=0.05 * torch.randn(BATCH, T, generator=gen), gamma=0.99, lam=0.95,
    ), gen


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_advantage_estimator_contract(name):
    fields, _ = _batch()
    mask = fields["response_mask"]
    advantages, returns = ADVANTAGE_ESTIMATORS.get(name)(AdvantageInputs(**fields))
    for out in (advantages, returns):
        assert out.shape == (BATCH, T)
        assert torch.isfinite(out).all()
        assert (out[~mask] == 0).all()
    with pytest.raises(ValueError, match=f"'{name}' needs AdvantageInputs"):
        ADVANTAGE_ESTIMATORS.get(name)(AdvantageInputs())


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_contract(name, agg_mode):
    fields, gen = _batch()
    mask = fields["response_mask"]
    logp = (-torch.rand(BATCH, T, generator=gen) * 3).requires_grad_(True)
    advantages = torch.randn(BATCH, 1, generator=gen).expand(BATCH, T) * mask
    common = dict(agg_mode=agg_mode, global_tokens=None, global_seqs=None, max_len=T,
                  clip_low=0.2, clip_high=0.28)

    loss, metrics = POLICY_LOSSES.get(name)(logp, logp.detach().clone(), advantages, mask, **common)
    assert loss.shape == () and torch.isfinite(loss)
    assert {"clip_frac", "approx_kl", "ratio_mean"} <= set(metrics)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    assert float(metrics["clip_frac"]) == 0.0
    assert float(metrics["approx_kl"]) == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()

    off_policy = logp.detach() + 0.3 * torch.randn(BATCH, T, generator=gen)
    loss, metrics = POLICY_LOSSES.get(name)(off_policy, logp.detach(), advantages, mask, **common)
    assert torch.isfinite(loss) and all(torch.isfinite(torch.as_tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_contract(name):
    gen = torch.Generator().manual_seed(0)
    logp, ref_logp = -torch.rand(2, BATCH, T, generator=gen) * 5
    kl = KL_ESTIMATORS.get(name)(logp, ref_logp)
    assert kl.shape == (BATCH, T) and torch.isfinite(kl).all()
    assert (KL_ESTIMATORS.get(name)(logp, logp) == 0).all()
