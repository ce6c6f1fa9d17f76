"""A PPO critic starts from the actor's backbone with a new value head, a reference policy is a
full copy; both in the actor's layout (tp=2, pp=2, dp=2 with the distributed optimizer), and the
critic's optimizer holds the copied weights (a zero-gradient step keeps them bit-identical).
An actor built from an HF directory (``model.path``) at tp=2, pp=2 with vpp=2 and (MoE) ep=2
holds the HF tensors bit-exactly, also after a zero-gradient optimizer step."""

import json

from tests.distributed.launch import torchrun
from tests.fixtures.hf_models import make_hf_model, make_tokenizer


def test_critic_reference_and_pretrained_actor(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    make_hf_model("llama", tmp_path / "hf" / "llama", tokenizer, train_steps=2)
    make_hf_model("qwen3_moe", tmp_path / "hf" / "qwen3_moe", tokenizer, train_steps=2)
    out = torchrun(2, "tests/distributed/copy_weights_worker.py", str(tmp_path))
    records = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(records) == 6
    for r in records[3:]:
        assert r["same_names"] and r["count"] > 0 and not r["differing"], r
    for r in records[:3]:
        assert r["all_ranks_ok"], r
        assert r["reference_copied"] == r["reference_params"], r
        last_stage_has_head = r["head"] == ["output_layer.bias", "output_layer.weight"]
        assert r["copied"] == r["critic_params"] - (2 if last_stage_has_head else 0), r
