"""Advantage estimators against values worked out by hand or by plain Python loops."""

from __future__ import annotations

import math
import statistics
from typing import Dict, List

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, masked_whiten, whiten_with_stats

# Right padding; padded rewards/values are garbage that must not leak in.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])


def estimate(name: str, **fields):
    return ADVANTAGE_ESTIMATORS.get(name)(AdvantageInputs(response_mask=MASK, **fields))


def test_gae_hand_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [2.0, 9.0, 9.0, 9.0], [0.0, 1.0, 9.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.5, 9.0, 9.0, 9.0], [0.0, 0.0, 9.0, 9.0]])
    adv, ret = estimate("gae", token_rewards=rewards, values=values, gamma=0.9, lam=0.8)
    # Row 0, gamma*lam = 0.72, V after the last token = 0:
    #   t=2: delta = 1 - 0.7 = 0.3                      A = 0.3
    #   t=1: delta = 0.9*0.7 - 0.6 = 0.03               A = 0.03 + 0.72*0.3 = 0.246
    #   t=0: delta = 0.9*0.6 - 0.5 = 0.04               A = 0.04 + 0.72*0.246 = 0.21712
    # Row 1: delta = 2 - 0.5 = 1.5.  Row 2: A1 = 1, A0 = 0 + 0.9*0 - 0 + 0.72*1 = 0.72.
    expected_adv = torch.tensor([[0.21712, 0.246, 0.3, 0.0], [1.5, 0, 0, 0], [0.72, 1.0, 0, 0]])
    expected_ret = torch.tensor([[0.71712, 0.846, 1.0, 0.0], [2.0, 0, 0, 0], [0.72, 1.0, 0, 0]])
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def test_gae_whiten_uses_valid_tokens_only():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [2.0, 9.0, 9.0, 9.0], [0.0, 1.0, 9.0, 9.0]])
    values = torch.zeros(3, 4)
    raw, _ = estimate("gae", token_rewards=rewards, values=values, gamma=0.9, lam=0.8)
    white, _ = estimate("gae", token_rewards=rewards, values=values, gamma=0.9, lam=0.8, whiten=True)
    valid = [raw[b, t].item() for b in range(3) for t in range(4) if MASK[b, t]]
    mean, std = statistics.fmean(valid), math.sqrt(statistics.pvariance(valid))
    for b in range(3):
        for t in range(4):
            expected = (raw[b, t].item() - mean) / std if MASK[b, t] else 0.0
            assert white[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_gae_skips_masked_tokens_inside_a_response():
    # A masked token (e.g. a tool observation) between two real ones is not a step.
    gapped, _ = ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(
        response_mask=torch.tensor([[1, 0, 1]]), token_rewards=torch.tensor([[0.0, 7.0, 1.0]]),
        values=torch.tensor([[0.5, 7.0, 0.7]]), gamma=0.9, lam=0.8))
    dense, _ = ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(
        response_mask=torch.tensor([[1, 1]]), token_rewards=torch.tensor([[0.0, 1.0]]),
        values=torch.tensor([[0.5, 0.7]]), gamma=0.9, lam=0.8))
    torch.testing.assert_close(gapped[:, [0, 2]], dense)
    assert gapped[0, 1] == 0


def test_whiten_with_global_stats_and_shift_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # valid 1,2,3,4: mean 2.5, population variance 1.25
    torch.testing.assert_close(
        whiten_with_stats(x, mask, mean=2.5, var=1.25, eps=0.0), masked_whiten(x, mask, eps=0.0))
    kept = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept[0], torch.tensor([-1.5, -0.5, 0.5]) / math.sqrt(1.25) + 2.5)
    assert kept[1, 1] == 0


# Groups: 7 -> rows 0, 2, 5 (not contiguous); 3 -> row 1 (size 1); 4 -> rows 3, 4 (equal rewards);
# 9 -> rows 6, 7.
SCORES = [1.0, 5.0, 0.0, 0.7, 0.7, 0.5, 1.0, 0.0]
INDEX = [7, 3, 7, 4, 4, 7, 9, 9]
GROUP_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1],
                           [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])


def group_estimate(name: str, **fields):
    return ADVANTAGE_ESTIMATORS.get(name)(AdvantageInputs(
        response_mask=GROUP_MASK, scores=torch.tensor(SCORES), index=torch.tensor(INDEX), **fields))


def groups() -> Dict[int, List[float]]:
    out: Dict[int, List[float]] = {}
    for score, gid in zip(SCORES, INDEX):
        out.setdefault(gid, []).append(score)
    return out


def assert_per_token(adv: torch.Tensor, per_row: List[float]) -> None:
    for b in range(len(per_row)):
        for t in range(GROUP_MASK.shape[1]):
            expected = per_row[b] if GROUP_MASK[b, t] else 0.0
            assert adv[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_grpo_uses_unbiased_std():
    # Group {1, 0}: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/sqrt(0.5) = +-0.7071 (biased would be +-1).
    adv, ret = ADVANTAGE_ESTIMATORS.get("grpo")(AdvantageInputs(
        response_mask=torch.ones(2, 1), scores=torch.tensor([1.0, 0.0]), index=torch.tensor([0, 0]),
        eps=0.0))
    torch.testing.assert_close(adv, torch.tensor([[math.sqrt(0.5)], [-math.sqrt(0.5)]]))
    torch.testing.assert_close(ret, adv)


def test_grpo_groups_loop():
    adv, _ = group_estimate("grpo", eps=1e-6)
    g = groups()
    expected = []
    for score, gid in zip(SCORES, INDEX):
        if len(g[gid]) == 1:
            expected.append(0.0)
        else:
            expected.append((score - statistics.fmean(g[gid])) / (statistics.stdev(g[gid]) + 1e-6))
    assert_per_token(adv, expected)
    assert torch.isfinite(adv).all()
    assert (adv[3] == 0).all() and (adv[4] == 0).all()  # equal rewards: no signal, no NaN
    assert (adv[1] == 0).all()  # size-1 group


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_equal_rewards_give_exactly_zero(name):
    # 7 x 0.1 and 16 x 0.7 do not average back to 0.1 / 0.7 in float32; a naive mean leaves a
    # residue that GRPO's 1/(std + eps) turns into advantages of ~0.01 to 0.1.
    scores = torch.tensor([0.1] * 7 + [0.7] * 16)
    index = torch.tensor([0] * 7 + [1] * 16)
    _, returns = ADVANTAGE_ESTIMATORS.get(name)(AdvantageInputs(
        response_mask=torch.ones(23, 2), scores=scores, index=index))
    assert (returns == 0).all()


def test_dr_grpo_only_centres():
    adv, _ = group_estimate("grpo", norm_by_std=False)
    g = groups()
    assert_per_token(adv, [s - statistics.fmean(g[gid]) for s, gid in zip(SCORES, INDEX)])


def test_rloo_leave_one_out_loop():
    adv, _ = group_estimate("rloo")
    expected = []
    for i, (score, gid) in enumerate(zip(SCORES, INDEX)):
        others = [SCORES[j] for j in range(len(SCORES)) if INDEX[j] == gid and j != i]
        expected.append(score - statistics.fmean(others) if others else 0.0)
    assert_per_token(adv, expected)
    # Hand check for group 9 = {1, 0}: 1 - 0 and 0 - 1.
    assert adv[6, 0].item() == pytest.approx(1.0) and adv[7, 0].item() == pytest.approx(-1.0)


def test_reinforce_pp_discounts_then_whitens():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0], [3.0, 9.0, 9.0, 9.0], [0.0, 2.0, 9.0, 9.0]])
    adv, ret = estimate("reinforce_pp", token_rewards=rewards, gamma=0.5)
    # Row 0: G = [0.25, 0.5, 1]; row 1: [3]; row 2: [1, 2].
    expected_ret = torch.tensor([[0.25, 0.5, 1.0, 0.0], [3.0, 0, 0, 0], [1.0, 2.0, 0, 0]])
    torch.testing.assert_close(ret, expected_ret)
    valid = [0.25, 0.5, 1.0, 3.0, 1.0, 2.0]
    mean, std = statistics.fmean(valid), math.sqrt(statistics.pvariance(valid))
    for b in range(3):
        for t in range(4):
            expected = (expected_ret[b, t].item() - mean) / std if MASK[b, t] else 0.0
            assert adv[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_reinforce_pp_baseline_centres_by_group_then_whitens():
    adv, ret = group_estimate("reinforce_pp_baseline")
    g = groups()
    centred = [s - statistics.fmean(g[gid]) for s, gid in zip(SCORES, INDEX)]
    assert_per_token(ret, centred)
    # Whitening statistics are over valid tokens, so longer responses weigh more.
    valid = [centred[b] for b in range(len(SCORES)) for t in range(3) if GROUP_MASK[b, t]]
    mean, std = statistics.fmean(valid), math.sqrt(statistics.pvariance(valid))
    assert_per_token(adv, [(c - mean) / std for c in centred])


def test_remax_subtracts_greedy_baseline():
    adv, ret = estimate("remax", scores=torch.tensor([1.0, 0.2, -1.0]),
                        baseline_scores=torch.tensor([0.5, 0.2, 1.0]))
    expected = torch.tensor([[0.5, 0.5, 0.5, 0.0], [0.0, 0, 0, 0], [-2.0, -2.0, 0, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


@pytest.mark.parametrize("name, missing", [
    ("gae", "values"), ("grpo", "index"), ("rloo", "index"), ("reinforce_pp", "token_rewards"),
    ("reinforce_pp_baseline", "index"), ("remax", "baseline_scores"),
])
def test_missing_input_is_named(name, missing):
    fields = dict(token_rewards=torch.zeros(3, 4), values=torch.zeros(3, 4), scores=torch.zeros(3),
                  index=torch.zeros(3, dtype=torch.long), baseline_scores=torch.zeros(3))
    del fields[missing]
    with pytest.raises(ValueError, match=f"'{name}' needs AdvantageInputs.{missing}"):
        estimate(name, **fields)
