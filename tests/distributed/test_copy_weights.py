"""A PPO critic starts from the actor's backbone with a new value head, a reference policy is a
full copy; both in the actor's layout (tp=2, pp=2, dp=2 with the distributed optimizer), and the
critic's optimizer holds the copied weights (a zero-gradient step keeps them bit-identical)."""

import json

from tests.distributed.launch import torchrun


def test_critic_and_reference_start_from_the_actor():
    out = torchrun(2, "tests/distributed/copy_weights_worker.py")
    records = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(records) == 3
    for r in records:
        assert r["all_ranks_ok"], r
        assert r["reference_copied"] == r["reference_params"], r
        last_stage_has_head = r["head"] == ["output_layer.bias", "output_layer.weight"]
        assert r["copied"] == r["critic_params"] - (2 if last_stage_has_head else 0), r
