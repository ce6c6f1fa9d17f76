"""Rollout correction: each mode's weights against a direct computation, non-finite padding, the
metrics, validation, and masked sequences contributing nothing to the policy gradient."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import POLICY_LOSSES
from megarl.algorithms.correction import ROLLOUT_CORRECTIONS, check_rollout_correction, rollout_correction_weights

B, T, C, LOW = 6, 5, 2.0, 0.5
TOL = 1e-6


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 4, 5, 2])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [B, T]
    rollout = -torch.rand(B, T, generator=gen) * 3
    old = rollout + 0.6 * torch.randn(B, T, generator=gen)  # log-ratios of both signs, some weights > C
    # padding carries garbage a careless implementation would turn into NaN
    old = torch.where(mask.bool(), old, torch.tensor(float("nan")))
    rollout = torch.where(mask.bool(), rollout, torch.tensor(float("-inf")))
    return old.double(), rollout.double(), mask.double()


def _direct(old, rollout, mask, mode):
    """Row by row, token by token, in float64 Python arithmetic; ``*_raw``: untruncated weights."""
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        n = int(mask[i].sum())
        logs = [float(old[i, t] - rollout[i, t]) for t in range(n)]
        ws = [math.exp(sum(logs))] * n if mode.startswith("seq_") else [math.exp(x) for x in logs]
        for t, w in enumerate(ws):
            if mode.endswith("_raw"):
                out[i, t] = w
            elif mode == "icepop":  # IcePop: kept within [alpha, beta], masked outside, both sides
                out[i, t] = w if LOW <= w <= C else 0.0
            else:
                out[i, t] = min(w, C) if mode.endswith("_tis") else (0.0 if w > C else w)
    return out


@pytest.mark.parametrize("mode", [m for m in ROLLOUT_CORRECTIONS if m != "none"])
def test_weights_equal_a_direct_computation(mode):
    old, rollout, mask = _batch()
    weights, metrics = rollout_correction_weights(old, rollout, mask, mode, C)
    want = _direct(old, rollout, mask, mode)
    assert torch.isfinite(weights).all() and (weights[mask == 0] == 0).all()
    assert (weights - want).abs().max().item() <= TOL
    valid = mask.bool()
    assert abs(metrics["weight_mean"].value.item() - want[valid].mean().item()) <= TOL
    assert abs(metrics["weight_max"].value.item() - want[valid].max().item()) <= TOL
    raw = _direct(old, rollout, mask, "token_raw" if mode == "icepop" else mode[:-3] + "raw")
    frac = metrics["frac_truncated" if mode.endswith("_tis") else "frac_masked"].value.item()
    assert 0 < frac < 1  # the batch has weights on both sides of C
    outside = (raw[valid] > C) | ((raw[valid] < LOW) if mode == "icepop" else False)
    assert abs(frac - outside.double().mean().item()) <= TOL
    if mode == "icepop":
        assert (raw[valid] < LOW).any() and (raw[valid] > C).any()  # both sides masked in this batch
    assert abs(metrics["ratio_max"].value.item() - raw[valid].max().item()) <= TOL
    assert all(torch.isfinite(m.value) for m in metrics.values())


def test_kl_is_k3_of_rollout_against_old_at_every_mode():
    old, rollout, mask = _batch()
    valid = mask.bool()
    x = (old - rollout)[valid]
    want = (torch.exp(x) - x - 1).mean().item()
    for mode in ROLLOUT_CORRECTIONS:
        weights, metrics = rollout_correction_weights(old, rollout, mask, mode, C)
        assert abs(metrics["kl"].value.item() - want) <= TOL and want > 0
    assert weights is not None and rollout_correction_weights(old, rollout, mask, "none", C)[0] is None


def test_equal_policies_give_unit_weights_and_zero_kl():
    old, _, mask = _batch()
    for mode in ROLLOUT_CORRECTIONS[1:]:
        weights, metrics = rollout_correction_weights(old, old, mask, mode, C)
        assert torch.equal(weights, mask) and metrics["kl"].value.item() == 0


def test_huge_log_ratios_stay_finite():
    old, rollout, mask = _batch()
    old = old + 500 * mask  # exp(500) overflows even float64 without the clamp
    for mode in ROLLOUT_CORRECTIONS[1:]:
        weights, metrics = rollout_correction_weights(old.float(), rollout.float(), mask.float(), mode, C)
        assert torch.isfinite(weights).all() and all(torch.isfinite(m.value) for m in metrics.values())


@pytest.mark.parametrize("mode,threshold,field", [
    ("tis", 2.0, "algorithm.rollout_correction='tis'"), ("token_tis", 1.0, "rollout_correction_threshold=1.0"),
    ("seq_mis", float("nan"), "rollout_correction_threshold=nan"), ("seq_mis", float("inf"), "threshold=inf")])
def test_validation_names_the_field(mode, threshold, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("[", r"\[")):
        check_rollout_correction(mode, threshold)
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction_threshold_low=1.5 must be in \(0, 1\)"):
        check_rollout_correction("icepop", 2.0, 1.5)


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
def test_seq_mis_masked_sequences_get_no_gradient(loss_name):
    """A tight threshold masks some responses: their log-probs' gradient is exactly 0, the others'
    is unchanged (denominators stay those of the mask, so the kept rows' loss is the same)."""
    old, rollout, mask = (x.float() for x in _batch())
    weights, _ = rollout_correction_weights(old, rollout, mask, "seq_mis", 1.05)
    masked = (weights == 0).all(-1) & (mask.sum(-1) > 0)
    kept = ~masked
    assert 0 < int(masked.sum()) < B
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(B, 1, generator=gen).expand(B, T).contiguous()
    logp = (old + 0.01 * torch.randn(B, T, generator=gen)).requires_grad_()
    loss, _ = POLICY_LOSSES.get(loss_name)(logp, old, advantages, mask, weights=weights, clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all()
    assert (grad[masked] == 0).all()
    assert (grad[kept][mask[kept].bool()] != 0).any()
    # kept rows: the gradient of the weighted loss is the weight times the unweighted one
    plain, _ = POLICY_LOSSES.get(loss_name)(logp, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    assert torch.allclose(grad[kept], (weights * plain_grad)[kept], atol=1e-7)
