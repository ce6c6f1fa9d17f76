"""The critic's loss: every aggregation mode, including Dr. GRPO's sum-norm, which needs the
generation budget (max_len) to reach the value loss."""

from types import SimpleNamespace

import pytest
import torch

from megarl.roles.critic import Critic, CriticLossConfig


def batch():
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float)
    return {"loss_mask": mask, "old_values": torch.randn(3, 5, generator=gen),
            "returns": torch.randn(3, 5, generator=gen)}, torch.randn(3, 5, generator=gen)


def critic(**kw):
    # _loss is the pure part of the role; the engine is only asked whether it ends in a value head
    return Critic(SimpleNamespace(vocab_size=None), CriticLossConfig(clip_range=0.1, **kw))


def test_sum_norm_divides_each_sequence_by_the_budget():
    t, values = batch()
    loss, count, metrics = critic(agg_mode="seq-mean-token-sum-norm", max_len=8)._loss(values, None, t)
    clipped = t["old_values"] + (values - t["old_values"]).clamp(-0.1, 0.1)
    per_token = 0.5 * torch.maximum((values - t["returns"]) ** 2, (clipped - t["returns"]) ** 2)
    expected = (per_token * t["loss_mask"]).sum() / 8  # per-sequence sums / max_len, summed over sequences
    assert count == 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert 0 < metrics["clip_frac"].value / count < 1


def test_sum_norm_without_a_budget_says_so():
    t, values = batch()
    with pytest.raises(ValueError, match="max_len"):
        critic(agg_mode="seq-mean-token-sum-norm")._loss(values, None, t)
