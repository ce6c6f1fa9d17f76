"""One-rank vocabulary-parallel log-probs and entropy: the gradient when the loss uses only one
of the two outputs (the entropy is detached at entropy_coef 0) equals log_softmax's, within 1e-6."""

import pytest
import torch

from megarl.engines.vocab_parallel import log_prob_and_entropy


@pytest.mark.parametrize("use", ["log_prob", "entropy", "both"])
def test_gradient_of_the_outputs_used(use):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen)  # 37 real tokens + 3 padding columns
    target = torch.randint(0, 37, (3, 5), generator=gen)
    weight = torch.randn(3, 5, generator=gen)

    def loss(logp, entropy):
        total = (weight * logp).sum() if use != "entropy" else 0
        return total + ((weight.flip(0) * entropy).sum() if use != "log_prob" else 0)

    mine = logits.clone().requires_grad_()
    loss(*log_prob_and_entropy(mine, target, vocab_size=37)).backward()
    ref = logits.clone().requires_grad_()
    log_p = torch.log_softmax(ref[..., :37], -1)
    loss(log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)).backward()
    assert (mine.grad - ref.grad).abs().max() <= 1e-6
