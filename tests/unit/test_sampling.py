"""Token selection: greedy, top-k, top-p, log-probs at the sampling temperature, the batched
sampler's distribution (chi-square at a fixed seed) and its per-row counter-based streams."""

import math

import pytest
import torch

from megarl.rollout import SamplingParams
from megarl.rollout.sampling import filter_logits, random_bits, row_key, row_keys, sample, uniforms


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
    tokens, logp = sample(logits, SamplingParams(temperature=0), row_keys([0]), 0)
    assert tokens.tolist() == [1]
    assert logp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    params = SamplingParams(temperature=0.5, top_k=1, seed=0)
    tokens, logp = sample(logits, params, row_keys([row_key(0, 0, 0)]), 0)
    assert tokens.tolist() == [1]  # top-k=1 leaves one choice
    # ...but the log-prob is of the full tempered distribution, as the trainer computes it
    assert logp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 1].item())
    assert logp.item() < 0


CHI2_4DOF_P001 = 18.47  # chi-square with 4 degrees of freedom: P(X > 18.47) = 0.001


def chi_square(tokens, probs):
    expected = torch.tensor(probs, dtype=torch.float64) * len(tokens)
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn outside the support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampling_follows_the_distribution():
    """20000 draws over 5 tokens, across rows (one call) and along one row's counter: chi-square
    below its 0.1% quantile (fixed keys, so the statistic is a fixed number: measured 2.09 and 4.31)."""
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    logits = torch.tensor(probs).log().repeat(20000, 1)
    across, _ = sample(logits, SamplingParams(temperature=1.0), row_keys(row_key(3, i, 0) for i in range(20000)), 0)
    along, _ = sample(logits, SamplingParams(temperature=1.0), row_keys([row_key(3, 0, 0)] * 20000),
                      torch.arange(20000))
    assert chi_square(across, probs) < CHI2_4DOF_P001 and chi_square(along, probs) < CHI2_4DOF_P001


def test_top_k_top_p_and_temperature_sample_the_renormalised_distribution():
    """T=0.5 squares the probabilities; top-k=4 then top-p=0.9 keep the nucleus, renormalised."""
    base = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = base.log().repeat(20000, 1)
    tempered = torch.softmax(base.log() / 0.5, -1)
    kept = torch.tensor([0.0, 1, 1, 1, 0])  # top-4 drops token 0; the nucleus of 0.9 keeps 1, 2, 3 (0.885 < 0.9)
    want = (tempered * kept / (tempered * kept).sum()).tolist()
    tokens, _ = sample(logits, SamplingParams(temperature=0.5, top_k=4, top_p=0.9),
                       row_keys(row_key(5, i, 0) for i in range(20000)), 0)
    assert chi_square(tokens, want) < 13.82  # 2 degrees of freedom: P(X > 13.82) = 0.001 (measured 0.20)


def test_a_rows_draws_do_not_depend_on_the_batch():
    """Row (seed 7, prompt 2, sample 1) draws the same tokens alone and among other rows in any
    order, at every counter; another sample index draws others."""
    torch.manual_seed(0)
    mine = torch.randn(1, 50)
    others = torch.randn(6, 50)
    key = row_key(7, 2, 1)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    for step in range(20):
        alone, logp = sample(mine, params, row_keys([key]), step)
        batch = torch.cat([others[:3], mine, others[3:]])
        keys = row_keys([row_key(7, i, 0) for i in range(3)] + [key] + [row_key(8, i, 0) for i in range(3)])
        together, batch_logp = sample(batch, params, keys, step)
        assert together[3] == alone[0] and batch_logp[3] == logp[0]
    draws = lambda k: [sample(mine, params, row_keys([k]), step)[0].item() for step in range(20)]
    assert draws(key) != draws(row_key(7, 2, 2))


def test_stream_bits_are_the_reference_hash():
    """The torch ops compute exactly the 32-bit hash written with Python integers (so CPU and CUDA
    draw the same numbers, and no int64 product overflows)."""
    def mix(x):
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    def reference(key, counter, lane):
        x = (0x9E3779B9, 0x7F4A7C15)[lane]
        for word in (key >> 32, key & 0xFFFFFFFF, counter):
            x = mix(x ^ word)
        return x

    keys = [0, 1, 0x7FFF_FFFF_FFFF_FFFF, row_key(1, 2, 3), row_key(-5, -1, 0)]
    for counter in (0, 1, 4095, 0xFFFFFFFF):
        for lane in (0, 1):
            assert random_bits(row_keys(keys), counter, lane).tolist() == [reference(k, counter, lane) for k in keys]
    u = uniforms(row_keys(keys), 3)
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == len(keys)


def test_streams_are_per_sample():
    a = uniforms(row_keys([row_key(1, 2, 3)]), torch.arange(3))
    b = uniforms(row_keys([row_key(1, 2, 3)]), torch.arange(3))
    c = uniforms(row_keys([row_key(1, 2, 4)]), torch.arange(3))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("kwargs,field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                          ({"n": 0}, "n="), ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
