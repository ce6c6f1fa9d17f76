"""Log-probs and entropy from vocabulary-parallel logits equal full-vocabulary log_softmax
(padding excluded, temperature applied), values and gradients, at tp = 1, 2 and 4; <= 1e-5."""

import json

import pytest

from tests.distributed.launch import torchrun


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_log_probs_match_full_softmax(world):
    out = torchrun(world, "tests/distributed/logprob_worker.py")
    (result,) = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert result["logp"] <= 1e-5 and result["entropy"] <= 1e-5 and result["grad"] <= 1e-5, result
