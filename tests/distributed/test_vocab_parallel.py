"""Log-probs and entropy from vocabulary-parallel logits equal full-vocabulary log_softmax
(padding excluded, temperature applied), values and gradients, at tp = 1, 2 and 4; <= 1e-5.
In the same sessions, context-parallel core attention at cp = 2 and 4 equals cp = 1 (float64,
forward and q/k/v gradients, padded, masked and packed; plain, and with a sliding window and
learnable sinks, whose gradient summed over the CP ranks equals cp = 1's): <= 1e-12."""

import json

import pytest

from tests.distributed.launch import torchrun


@pytest.fixture(scope="module", params=[1, 2, 4])
def results(request):
    out = torchrun(request.param, "tests/distributed/logprob_worker.py")
    found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return request.param, {r["check"]: r for r in found}


def test_vocab_parallel_log_probs_match_full_softmax(results):
    _, found = results
    result = found["vocab"]
    assert result["logp"] <= 1e-5 and result["entropy"] <= 1e-5 and result["grad"] <= 1e-5, result


def test_context_parallel_attention_matches_one_rank(results):
    world, found = results
    if world == 1:
        assert "cp" not in found
        return
    result = found["cp"]
    assert result["split_matches_megatron"] == 1.0, result
    assert result["max_diff"] <= 1e-12, result
