"""Token selection: greedy, top-k, top-p, log-probs at the sampling temperature, per-sample streams."""

import math

import pytest
import torch

from megarl.rollout import SamplingParams
from megarl.rollout.sampling import filter_logits, generator_for, sample


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_logits(logits, 2, 1.0))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, 0, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.1)).tolist() == [[True, False, False, False]]


def test_greedy_and_log_probs_at_temperature():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tokens, logp = sample(logits, SamplingParams(temperature=0), [torch.Generator()])
    assert tokens.tolist() == [1]
    assert logp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    params = SamplingParams(temperature=0.5, top_k=1, seed=0)
    tokens, logp = sample(logits, params, [generator_for(0, 0, 0)])
    assert tokens.tolist() == [1]  # top-k=1 leaves one choice
    # ...but the log-prob is of the full tempered distribution, as the trainer computes it
    assert logp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 1].item())
    assert logp.item() < 0


def test_sampling_follows_the_distribution():
    logits = torch.tensor([math.log(0.7), math.log(0.2), math.log(0.1)]).repeat(4000, 1)
    gens = [generator_for(3, i, 0) for i in range(4000)]
    tokens, _ = sample(logits, SamplingParams(temperature=1.0), gens)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_streams_are_per_sample():
    a = torch.rand(3, generator=generator_for(1, 2, 3))
    b = torch.rand(3, generator=generator_for(1, 2, 3))
    c = torch.rand(3, generator=generator_for(1, 2, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("kwargs,field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                          ({"n": 0}, "n="), ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
