"""The SGLang rollout in the loop, the parts without processes: the split placement's bucket plan
(names and shapes of transformers' own checkpoint, every bucket within its budget, the same list
every time), per-request seeds, the HF directory SGLang starts from, the errors without SGLang or
CUDA, and the Rollout role's memory order (the KV cache comes back only after the offload).
The adapter against a recording SGLang stand-in runs in test_rollout.py's torchrun session."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.config import ModelConfig
from megarl.hybrid import SyncStats
from megarl.config.schema import RolloutLayoutConfig
from megarl.models.hf_config import megatron_args_from_hf
from megarl.roles.rollout import Rollout
from megarl.rollout.sglang_engine import colocated_rollout, request_params, write_hf_dir
from megarl.rollout.types import RolloutEngine, SamplingParams
from megarl.transports.nccl_broadcast import hf_bucket_plan

NAMES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral",
         "tiny-deepseek-v3", "tiny-glm4-moe"]


@pytest.mark.parametrize("name", NAMES)
def test_bucket_plan_is_the_hf_checkpoint(name, tmp_path):
    path = f"configs/models/{name}.json"
    args = megatron_args_from_hf(path)
    budget = 20 << 10
    plan = hf_bucket_plan(args, torch.bfloat16, budget)
    assert plan == hf_bucket_plan(args, torch.bfloat16, budget)  # deterministic: both sides compute it
    planned = [(t.name, t.shape) for b in plan for t in b.tensors]
    assert len(planned) == len(set(planned))
    assert all(t.dtype == torch.bfloat16 for b in plan for t in b.tensors)
    # every bucket within the budget, unless it is one Megatron tensor larger than the budget
    assert all(b.nbytes <= budget or len(b.keys) == 1 for b in plan)
    assert any(len(b.keys) > 1 for b in plan) and len(plan) > 2
    # consecutive buckets could not have been merged (greedy, in model order)
    assert all(a.nbytes + b.nbytes > budget for a, b in zip(plan, plan[1:]))
    config = transformers.AutoConfig.for_model(**json.load(open(path)))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    expected = {}
    for file in tmp_path.glob("*.safetensors"):
        expected.update({k: tuple(v.shape) for k, v in load_file(file).items()})
    assert dict(planned) == expected


def test_bucket_plan_refuses_stacked_experts_by_name():
    from megarl.models.hf_config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="gpt_oss"):
        hf_bucket_plan(megatron_args_from_hf("configs/models/tiny-gpt-oss.json"), torch.bfloat16, 1 << 20)


def test_bucket_plan_rejects_a_zero_budget():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        hf_bucket_plan(megatron_args_from_hf("configs/models/tiny-llama.json"), torch.float32, 0)


def test_request_seeds_differ_per_sample_and_repeat():
    rows = [(p, s) for p in range(3) for s in range(4)]
    seeded = request_params(rows, SamplingParams(temperature=0.7, top_k=5, n=4, max_new_tokens=9, seed=11,
                                                 stop_token_ids=[2]))
    assert len({p["sampling_seed"] for p in seeded}) == 12
    assert seeded == request_params(rows, SamplingParams(temperature=0.7, top_k=5, n=4, max_new_tokens=9, seed=11,
                                                         stop_token_ids=[2]))
    assert seeded[0] | {"sampling_seed": 0} == {"temperature": 0.7, "top_p": 1.0, "top_k": 5, "max_new_tokens": 9,
                                                "stop_token_ids": [2], "sampling_seed": 0}
    unseeded = request_params(rows, SamplingParams())
    assert "sampling_seed" not in unseeded[0] and unseeded[0]["top_k"] == -1  # SGLang's "off"


def test_hf_dir_holds_config_and_tokenizer(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "config.json").write_text('{"stale": true}')
    args = megatron_args_from_hf("configs/models/tiny-llama.json")
    out = write_hf_dir(args.hf_config, torch.bfloat16, str(tok))
    assert sorted(p.name for p in Path(out).iterdir()) == ["config.json", "tokenizer.json"]
    config = json.loads((Path(out) / "config.json").read_text())
    assert config == args.hf_config | {"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
                                       "torch_dtype": "bfloat16"}
    with pytest.raises(FileNotFoundError, match="data.tokenizer="):
        write_hf_dir(args.hf_config, torch.float32, str(tmp_path / "missing"))


def _colocated():
    return colocated_rollout(ModelConfig(hf_config="configs/models/tiny-llama.json"), RolloutLayoutConfig(engine="sglang"),
                             megatron_args_from_hf("configs/models/tiny-llama.json"), None, [])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_colocated_without_sglang_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'megarl\[sglang\]'"):
        _colocated()


def test_colocated_without_cuda_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA GPUs.*rollout.engine=native"):
        _colocated()


class RecordingEngine(RolloutEngine):
    def __init__(self, log):
        self.log = log
        self.resharder = types.SimpleNamespace(last=SyncStats(seconds=0.5, bytes_received=64))

    def generate(self, prompts, sampling):
        self.log.append("generate")
        return []

    def update_weights(self, policy_version):
        self.log.append("update_weights")

    def release_memory(self):
        self.log.append("release")

    def resume_memory(self):
        self.log.append("resume_weights")

    def resume_kv_cache(self):
        self.log.append("resume_kv_cache")


class RecordingPhases:
    def __init__(self, log):
        self.log = log

    def enter_generate(self):
        self.log.append("offload")
        return {"time/offload_s": 0.25}

    def enter_train(self):
        self.log.append("reload")


def test_role_resumes_kv_cache_after_the_offload():
    log = []
    role = Rollout(RecordingEngine(log), RecordingPhases(log))
    role.resume_memory()
    metrics = role.update_weights(3)
    role.generate([[1]], SamplingParams())
    role.release_memory()
    assert log == ["resume_weights", "update_weights", "offload", "resume_kv_cache", "generate", "release", "reload"]
    assert metrics == {"sync/seconds": 0.5, "sync/bytes_received": 64, "time/offload_s": 0.25,
                       "sync/peak_extra_mb": 0.0, "sync/delta_copy_mb": 0.0}  # whole tensors: no dense base


def test_kv_cache_hook_is_a_no_op_by_default():
    class Bare(RolloutEngine):
        def generate(self, prompts, sampling):
            return []

        def update_weights(self, policy_version):
            pass

    assert Bare().resume_kv_cache() is None
