"""Aggregation, policy, value, entropy and KL losses against hand arithmetic and explicit loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megarl.algorithms import (
    AGG_MODES,
    POLICY_LOSSES,
    aggregate,
    entropy_bonus,
    kl_loss,
    loss_denominators,
    value_loss,
)

DT = torch.float64
X = 1e3  # garbage at masked positions; must not leak into any result


def test_aggregate_modes_by_hand():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, X], [4.0, X, X, X], [X, X, X, X]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the empty row is no sequence
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(
        (6 / 8 + 4 / 8) / 2)
    assert aggregate(loss_mat, mask, "token-mean", global_tokens=20).item() == pytest.approx(0.5)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum", global_seqs=5).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate(loss_mat, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="available: token-mean"):
        aggregate(loss_mat, mask, "mean")


def _random_batch(gen: torch.Generator, batch: int, max_len: int):
    lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
    lengths[0] = max_len
    mask = (torch.arange(max_len)[None, :] < lengths[:, None]).to(DT)  # [batch, T], right padding
    features = torch.randn(batch, max_len, generator=gen, dtype=DT)
    return mask, features


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregate_is_additive_over_microbatches_and_ranks(mode, seed):
    """Summing micro-batch losses (any split, any DP ranks, each micro-batch trimmed to its own
    padded length) with global denominators gives the whole batch's loss and gradient."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    batch, max_len = 13, 9
    mask, features = _random_batch(gen, batch, max_len)
    weight = torch.randn(max_len, dtype=DT, generator=gen)

    def loss_matrix(rows, cols, w):
        return torch.tanh(features[rows][:, :cols] * w[:cols]) ** 2  # [rows, cols]

    full_w = weight.clone().requires_grad_(True)
    full = aggregate(loss_matrix(list(range(batch)), max_len, full_w), mask, mode, max_len=max_len)
    full.backward()

    # Random DP ranks, each split into random micro-batches.
    order = list(range(batch))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, batch), 5))
    micro_batches = [order[a:b] for a, b in zip([0] + cuts, cuts + [batch])]
    ranks = [micro_batches[:2], micro_batches[2:3], micro_batches[3:]]
    tokens = sum(loss_denominators(mask[mb])[0] for rank in ranks for mb in rank)
    seqs = sum(loss_denominators(mask[mb])[1] for rank in ranks for mb in rank)

    part_w = weight.clone().requires_grad_(True)
    total = torch.zeros((), dtype=DT)
    for rank in ranks:
        for rows in rank:
            cols = max(int(mask[rows].sum(-1).max()), 1)
            part = aggregate(loss_matrix(rows, cols, part_w), mask[rows][:, :cols], mode,
                             global_tokens=tokens, global_seqs=seqs, max_len=max_len)
            part.backward()  # gradient accumulation, as in the trainer
            total = total + part.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(part_w.grad, full_w.grad)

    # Independent check of the whole-batch value with plain loops.
    loss_values = loss_matrix(list(range(batch)), max_len, weight).tolist()
    lengths = [int(n) for n in mask.sum(-1).tolist()]
    rows = [loss_values[b][:lengths[b]] for b in range(batch) if lengths[b] > 0]
    if mode == "token-mean":
        expected = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    elif mode == "seq-mean-token-sum":
        expected = sum(sum(r) for r in rows) / len(rows)
    elif mode == "seq-mean-token-mean":
        expected = sum(sum(r) / len(r) for r in rows) / len(rows)
    else:
        expected = sum(sum(r) / max_len for r in rows) / len(rows)
    assert full.item() == pytest.approx(expected)


def _logps(ratios, old=-1.0):
    ratios = torch.tensor(ratios, dtype=DT)
    old_logp = torch.full_like(ratios, old)
    logp = (old_logp + torch.log(ratios)).requires_grad_(True)
    return logp, old_logp


def test_ppo_ratio_one_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -3.0, X]], dtype=DT)
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, X]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, metrics = POLICY_LOSSES.get("ppo")(logp, logp.clone(), adv, mask, agg_mode="token-mean")
    assert loss.item() == pytest.approx(-(1 - 2 + 0.5 + 3 + 1) / 5)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["clip_frac"].item() == 0.0


def test_ppo_clip_higher_boundaries():
    # clip range [0.8, 1.28]; the last token is padding.
    logp, old_logp = _logps([[1.25, 1.35, 0.75, 0.85, 0.75, 1.5, 50.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0, X]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    loss, metrics = POLICY_LOSSES.get("ppo")(
        logp, old_logp, adv, mask, agg_mode="token-mean", clip_low=0.2, clip_high=0.28)
    # Per token max(-A r, -A clip(r)):
    #   r=1.25 A=+1: -1.25 (inside 1.28; a symmetric 0.2 would clip it)   r=1.35 A=+1: -1.28 clipped
    #   r=0.75 A=-1: 0.8 clipped       r=0.85 A=-1: 0.85                  r=0.75 A=+1: -0.75
    #   r=1.5  A=-1: 1.5 (the pessimistic side keeps the unclipped term)
    per_token = [-1.25, -1.28, 0.8, 0.85, -0.75, 1.5]
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 6)
    loss.backward()
    # d/dlogp of -A r / 6 = -A r / 6 where unclipped, 0 where clipped or masked.
    expected_grad = [-1.25 / 6, 0.0, 0.0, 0.85 / 6, -0.75 / 6, 1.5 / 6, 0.0]
    torch.testing.assert_close(logp.grad[0], torch.tensor(expected_grad, dtype=DT))


def test_ppo_dual_clip_caps_negative_advantage():
    logp, old_logp = _logps([[10.0, 2.0, 10.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=DT)
    mask = torch.ones(1, 3)
    loss, metrics = POLICY_LOSSES.get("ppo")(
        logp, old_logp, adv, mask, agg_mode="token-mean",
        clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    # r=10 A=-1: max(10, 1.28) = 10 capped at -c*A = 3; r=2 A=-1: 2 < 3 kept; A>0 untouched: -1.28.
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.28) / 3)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.0, 2.0 / 3, 0.0], dtype=DT))
    with pytest.raises(ValueError, match="dual_clip_c=1.0 must be > 1"):
        POLICY_LOSSES.get("ppo")(logp, old_logp, adv, mask, dual_clip_c=1.0)


# GSPO: three sequences, lengths 3, 2, 3; advantages constant per sequence.
GSPO_DIFFS = [[0.1, -0.05, 0.04], [0.3, 0.2], [-0.3, 0.1, -0.1]]  # logp - old_logp
GSPO_ADV = [1.0, 2.0, -1.0]
GSPO_CLIP = (0.1, 0.2)  # ratio range [0.9, 1.2]


def _gspo_batch():
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.5, X], [-2.0, -0.1, -1.2]], dtype=DT)
    diffs = torch.tensor([d + [0.0] * (3 - len(d)) for d in GSPO_DIFFS], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[a] * 3 for a in GSPO_ADV], dtype=DT)
    return old_logp + diffs, old_logp, adv, mask


def _gspo_reference(logp, old_logp):
    """Sequence-level GSPO objective with explicit per-sequence loops."""
    total = torch.zeros((), dtype=DT)
    for i, diffs in enumerate(GSPO_DIFFS):
        n = len(diffs)
        s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in range(n)) / n)
        a = GSPO_ADV[i]
        total = total + torch.maximum(-a * s, -a * torch.clamp(s, 1 - GSPO_CLIP[0], 1 + GSPO_CLIP[1]))
    return total / len(GSPO_DIFFS)


def test_gspo_sequence_ratio_loss_and_gradient():
    logp, old_logp, adv, mask = _gspo_batch()
    logp.requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get("gspo")(
        logp, old_logp, adv, mask, agg_mode="seq-mean-token-mean",
        clip_low=GSPO_CLIP[0], clip_high=GSPO_CLIP[1])
    # s = e^0.03 = 1.0305 (inside), e^0.25 = 1.284 (> 1.2, clipped: -2 * 1.2), e^-0.1 = 0.9048.
    by_hand = (-math.exp(0.03) - 2 * 1.2 + math.exp(-0.1)) / 3
    assert loss.item() == pytest.approx(by_hand)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 8)  # the clipped sequence's 2 tokens
    loss.backward()

    ref_logp = logp.detach().clone().requires_grad_(True)
    _gspo_reference(ref_logp, old_logp).backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad)
    # Gradient of the clipped sequence vanishes; others are -A s / (3 |y_i|) per token.
    torch.testing.assert_close(logp.grad[1], torch.zeros(3, dtype=DT))
    assert logp.grad[0, 0].item() == pytest.approx(-math.exp(0.03) / 9)

    # Central finite differences of the loss itself agree with its autograd gradient.
    h = 1e-6
    for i, t in [(0, 0), (0, 2), (2, 1)]:
        bumped = [logp.detach().clone() for _ in range(2)]
        bumped[0][i, t] += h
        bumped[1][i, t] -= h
        up, down = (POLICY_LOSSES.get("gspo")(b, old_logp, adv, mask, agg_mode="seq-mean-token-mean",
                                              clip_low=GSPO_CLIP[0], clip_high=GSPO_CLIP[1])[0]
                    for b in bumped)
        assert ((up - down) / (2 * h)).item() == pytest.approx(logp.grad[i, t].item(), rel=1e-6)


def test_gspo_refuses_dual_clip():
    logp, old_logp, adv, mask = _gspo_batch()
    with pytest.raises(ValueError, match="no dual clip"):
        POLICY_LOSSES.get("gspo")(logp, old_logp, adv, mask, dual_clip_c=3.0)


def test_value_loss_clipping():
    values = torch.tensor([[1.5, 1.1, 0.5, 1.5, X]], dtype=DT, requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0, 1.0, X]], dtype=DT)
    returns = torch.tensor([[2.0, 2.0, 0.0, 1.0, X]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range=0.2)
    # V_clip = 1.2, 1.1, 0.8, 1.2; 0.5 * max((V-R)^2, (V_clip-R)^2):
    #   max(0.25, 0.64)=0.64 clipped; 0.81; max(0.25, 0.64)=0.64 clipped; max(0.25, 0.04)=0.25
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64 + 0.25) / 4)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # Gradient only where the unclipped error is used: (V - R) / 4.
    torch.testing.assert_close(values.grad[0], torch.tensor([0.0, -0.9 / 4, 0.0, 0.5 / 4, 0.0], dtype=DT))


def test_entropy_bonus_and_kl_loss():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    entropy = torch.tensor([[1.0, 3.0, X], [5.0, X, X]])
    assert entropy_bonus(entropy, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 5) / 2)
    logp = torch.tensor([[-1.0, -2.0, X], [-0.5, X, X]])
    ref_logp = torch.tensor([[-2.0, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    assert kl_loss(logp, ref_logp, mask, "k1", "token-mean").item() == pytest.approx((1 - 1 + 0) / 3)
    assert kl_loss(logp, ref_logp, mask, "k2", "token-mean").item() == pytest.approx((0.5 + 0.5) / 3)
    with pytest.raises(KeyError, match="unknown KL estimator 'k4'"):
        kl_loss(logp, ref_logp, mask, "k4")


# Numerical safety: a log-ratio far beyond exp's fp32 range on a real token, and inf/NaN at padding.
def _overflow_batch():
    """float32, two sequences; token (0, 1) has log-ratio 100 (exp overflows fp32 at 89)."""
    old_logp = torch.tensor([[-1.0, -101.0, -0.5], [-0.7, -1.5, -2.0]])
    logp = torch.tensor([[-1.1, -1.0, -0.4], [-0.6, -1.5, -2.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, old_logp, adv, mask


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_ppo_overflowing_log_ratio_is_clamped(dual_clip_c):
    logp, old_logp, adv, mask = _overflow_batch()
    loss, metrics = POLICY_LOSSES.get("ppo")(
        logp, old_logp, adv, mask, agg_mode="token-mean", dual_clip_c=dual_clip_c)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    # The overflowing token (A=-1) keeps its unclipped term at the bound, e^20, or the dual-clip cap
    # 3; its gradient is 0 either way (beyond the clamp, or capped). Other tokens as unclamped.
    others = [math.exp(-0.1), math.exp(0.1), -2 * math.exp(0.1), -2.0]  # -A r, all inside the clip
    overflow = math.exp(20.0) if dual_clip_c is None else 3.0
    assert loss.item() == pytest.approx((overflow + sum(others)) / 5, rel=1e-6, abs=1e-6)
    assert logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 0].item() == pytest.approx(math.exp(-0.1) / 5, rel=1e-6)


def test_gspo_and_k3_overflowing_log_ratio_are_clamped():
    logp, old_logp, adv, mask = _overflow_batch()
    loss, _ = POLICY_LOSSES.get("gspo")(logp, old_logp, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    logp.grad = None
    # k3 = e^x - x - 1 with x = ref - logp: 100 on token (0, 1), clamped to 20; 0 elsewhere.
    ref_logp = logp.detach().clone()
    ref_logp[0, 1] += 100.0
    kl = kl_loss(logp, ref_logp, mask, "k3", "token-mean")
    kl.backward()
    assert kl.item() == pytest.approx((math.exp(20.0) - 21) / 5, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.zeros_like(logp), rtol=0, atol=0)


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_non_finite_padding_changes_no_loss_or_gradient(garbage, agg_mode):
    """inf/NaN at masked positions of every input: every loss and gradient equal the clean case's."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    shape = mask.shape
    clean = {name: torch.randn(shape, generator=gen) * 0.3 - (1.0 if "logp" in name else 0.0)
             for name in ("logp", "old_logp", "ref_logp", "adv", "entropy", "values", "old_values", "returns")}
    dirty = {k: torch.where(mask.bool(), v, torch.tensor(garbage)) for k, v in clean.items()}
    kw = dict(agg_mode=agg_mode, max_len=4)

    def losses_and_grads(t):
        leaves = {k: t[k].clone().requires_grad_(True) for k in ("logp", "entropy", "values")}
        lp, ent, val = leaves["logp"], leaves["entropy"], leaves["values"]
        total = []
        for name, extra in [("ppo", {}), ("ppo", {"dual_clip_c": 3.0}), ("gspo", {})]:
            total.append(POLICY_LOSSES.get(name)(lp, t["old_logp"], t["adv"], mask, **kw, **extra)[0])
        for est in ("k1", "k2", "k3"):
            total.append(kl_loss(lp, t["ref_logp"], mask, est, **kw))
        total.append(entropy_bonus(ent, mask, **kw))
        total.append(value_loss(val, t["old_values"], t["returns"], mask, 0.2, **kw)[0])
        values = torch.stack(total)
        values.sum().backward()
        return values.detach(), [leaf.grad for leaf in leaves.values()]

    want_values, want_grads = losses_and_grads(clean)
    got_values, got_grads = losses_and_grads(dirty)
    assert torch.isfinite(want_values).all()
    torch.testing.assert_close(got_values, want_values, rtol=0, atol=0)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
