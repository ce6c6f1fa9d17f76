"""Preference losses (megarl.algorithms.preference; issue 45) against float64 references written
from the papers, per pair with ``math``, on random inputs: Bradley–Terry, DPO (sigmoid, label
smoothed) and IPO; their values and the gradients with respect to every input."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.preference import bradley_terry, dpo

PAIRS = 16


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def dpo_reference(pc, pr, rc, rr, beta, variant, eps):
    """The loss of one pair from the papers' formulas, in float64 Python floats."""
    h = (pc - rc) - (pr - rr)
    if variant == "ipo":  # Azar et al. 2023, eq. 17
        return (h - 1 / (2 * beta)) ** 2
    return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)  # Rafailov eq. 7; cDPO


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    # sequence log-probs: sums over ~10 tokens, the reference near the policy
    policy = -torch.rand(2, PAIRS, generator=g, dtype=torch.float64) * 20
    ref = policy + torch.randn(2, PAIRS, generator=g, dtype=torch.float64) * 2
    return policy[0], policy[1], ref[0], ref[1]


@pytest.mark.parametrize("variant,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0),
                                              ("ipo", 1.0, 0.0)])
def test_dpo_values_and_gradients_equal_the_formula(variant, beta, eps):
    pc, pr, rc, rr = inputs(7)
    got = [t.float().requires_grad_() for t in (pc, pr)]
    losses, m = dpo(got[0], got[1], rc.float(), rr.float(), beta, variant, eps)
    want = [dpo_reference(*(float(t[i]) for t in (pc, pr, rc, rr)), beta, variant, eps) for i in range(PAIRS)]
    assert torch.allclose(losses.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    losses.mean().backward()
    # the reference's gradients by float64 autograd of the same formula per pair
    ref = [t.clone().requires_grad_() for t in (pc, pr)]
    h = (ref[0] - rc) - (ref[1] - rr)
    per = (h - 1 / (2 * beta)) ** 2 if variant == "ipo" else \
        -(1 - eps) * torch.nn.functional.logsigmoid(beta * h) - eps * torch.nn.functional.logsigmoid(-beta * h)
    per.mean().backward()
    for mine, theirs in zip(got, ref):  # float32 log-probs near -20 round h by ~2e-6: IPO's gradient is 2h/16
        assert torch.allclose(mine.grad.double(), theirs.grad, rtol=1e-5, atol=1e-6)
    chosen = [beta * (float(pc[i]) - float(rc[i])) for i in range(PAIRS)]
    rejected = [beta * (float(pr[i]) - float(rr[i])) for i in range(PAIRS)]
    assert m["chosen_reward"].double().tolist() == pytest.approx(chosen, rel=1e-5, abs=1e-6)
    assert m["accuracy"].tolist() == [float(c > r) for c, r in zip(chosen, rejected)]
    assert m["margin"].double().tolist() == pytest.approx([c - r for c, r in zip(chosen, rejected)], rel=1e-4, abs=1e-5)
    assert 0 < m["accuracy"].mean() < 1


def test_dpo_at_the_start_is_log_2_and_checks_its_knobs():
    pc, pr = torch.tensor([-3.0, -7.0]), torch.tensor([-4.0, -2.0])
    losses, m = dpo(pc, pr, pc.clone(), pr.clone(), beta=0.1)  # the policy is its reference
    assert torch.allclose(losses, torch.full((2,), math.log(2))) and m["accuracy"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        dpo(pc, pr, pc, pr, beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must be in \[0, 0.5\)"):
        dpo(pc, pr, pc, pr, beta=0.1, label_smoothing=0.5)
    with pytest.raises(KeyError, match="unknown DPO variant 'kto'; available: ipo, sigmoid"):
        dpo(pc, pr, pc, pr, beta=0.1, variant="kto")


def test_bradley_terry_equals_the_formula():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, PAIRS, generator=g, dtype=torch.float64) * 3
    chosen, rejected = (t.float().requires_grad_() for t in s)
    losses, m = bradley_terry(chosen, rejected)
    want = [-log_sigmoid(float(s[0, i] - s[1, i])) for i in range(PAIRS)]
    assert losses.double().tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    losses.sum().backward()
    sig = [1 / (1 + math.exp(float(s[0, i] - s[1, i]))) for i in range(PAIRS)]  # d/ds_c = -σ(-(s_c - s_r))
    assert chosen.grad.double().tolist() == pytest.approx([-x for x in sig], rel=1e-5, abs=1e-6)
    assert rejected.grad.double().tolist() == pytest.approx(sig, rel=1e-5, abs=1e-6)
    assert m["accuracy"].tolist() == [float(s[0, i] > s[1, i]) for i in range(PAIRS)]
