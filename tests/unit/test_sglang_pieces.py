"""The SGLang rollout's CPU parts: Megatron → HF names (checked against transformers' own
state dict for every architecture), joining generation-TP shards, buckets, flat buffers and the
per-TP-rank payload layout; the missing extra is named."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.hybrid import ModelSpec
from megarl.hybrid.shards import Placement
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout
from megarl.hybrid.hf_names import HFNames, assemble, checkpoint_key
from megarl.rollout.sglang_engine import require_sglang
from megarl.transports.cuda_ipc import buckets, flatten, payloads_by_name, unflatten

NAMES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral",
         "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-qwen3-next", "tiny-qwen3-5-moe"]


@pytest.mark.parametrize("name", NAMES)
def test_hf_names_match_transformers(name, tmp_path):
    """Against the tensors of a checkpoint transformers writes (per-expert names: the format
    SGLang's loaders read, whatever transformers fuses in memory)."""
    path = f"configs/models/{name}.json"
    args = megatron_args_from_hf(path)
    model = ModelSpec.from_args(args)
    names = HFNames(args)
    gen = torch.Generator().manual_seed(0)
    produced = {}
    for spec in model.tensors:
        for hf_name, tensor in names(spec.key, torch.randn(spec.shape, generator=gen)):
            assert hf_name not in produced, f"{hf_name} produced twice"
            produced[hf_name] = tensor
    config = transformers.AutoConfig.for_model(**json.load(open(path)))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    expected = {}
    for file in tmp_path.glob("*.safetensors"):
        expected.update({k: tuple(v.shape) for k, v in load_file(file).items()})
    assert {k: tuple(v.shape) for k, v in produced.items()} == expected


def test_stacked_experts_are_refused_by_name():
    """GptOss's checkpoint stacks every expert of a layer in one tensor; the weight sync hands over
    one expert at a time, so the SGLang/vLLM engines refuse it before any transfer."""
    from megarl.models.hf_config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="gpt_oss.*experts.gate_up_proj.*rollout.engine=native"):
        HFNames(megatron_args_from_hf("configs/models/tiny-gpt-oss.json"))


def test_checkpoint_keys():
    assert checkpoint_key("decoder.layers.3.input_layernorm.weight", mla=False) == (
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", None)
    assert checkpoint_key("decoder.layers.3.input_layernorm.weight", mla=True) == (
        "decoder.layers.3.input_layernorm.weight", None)
    assert checkpoint_key("decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight", mla=False) == (
        "decoder.layers.1.mlp.experts.experts.linear_fc2.weight", 7)
    assert checkpoint_key("output_layer.weight", mla=False) == ("output_layer.weight", None)


def test_gate_up_and_qkv_go_back_to_hf_layout():
    args = megatron_args_from_hf("configs/models/tiny-llama.json")
    names = HFNames(args)
    fc1 = torch.arange(256 * 64, dtype=torch.float32).view(256, 64)  # [gate; up]
    (gate_name, gate), (up_name, up) = names("decoder.layers.0.mlp.linear_fc1.weight", fc1)
    assert gate_name.endswith("gate_proj.weight") and torch.equal(gate, fc1[:128])
    assert up_name.endswith("up_proj.weight") and torch.equal(up, fc1[128:])
    qkv = names("decoder.layers.0.self_attention.linear_qkv.weight", torch.randn(128, 64))
    assert [n.rsplit(".", 2)[-2] for n, _ in qkv] == ["q_proj", "k_proj", "v_proj"]
    assert [tuple(t.shape) for _, t in qkv] == [(64, 64), (32, 64), (32, 64)]


@pytest.mark.parametrize("tp", [2, 4])
def test_assemble_joins_fused_shards(tp):
    model = ModelSpec.from_args(megatron_args_from_hf("configs/models/tiny-qwen2.json"))
    layout = Layout(tp=tp)
    placement = Placement(model, layout)
    index = model.index()
    for key in ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_proj.weight",
                "embedding.word_embeddings.weight"]:
        spec = model.tensors[index[key]]
        full = torch.randn(spec.shape)
        locals_ = [next(t for t in placement.local_tensors(r) if t.spec == index[key]) for r in range(tp)]
        shards = [torch.cat([full.narrow(spec.split_dim, p.start, p.stop - p.start) for p in t.pieces], spec.split_dim)
                  for t in locals_]
        assert torch.equal(assemble(shards, locals_, spec.split_dim, spec.shape[spec.split_dim]), full)


def test_buckets_flatten_and_payloads():
    named = [(f"t{i}", torch.full((i + 1, 3), float(i))) for i in range(6)]
    groups = buckets(named, bucket_bytes=4 * 3 * 5)
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    flat, entries = flatten(named)
    assert flat.numel() == sum(t.numel() for _, t in named)
    assert all(torch.equal(a, b) and n == m for (n, a), (m, b) in zip(named, unflatten(flat, entries)))
    with pytest.raises(ValueError, match="bucket by dtype"):
        flatten([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    per_rank = [[("a", "a0"), ("b", "b0")], [("a", "a1"), ("b", "b1")]]
    assert payloads_by_name(per_rank) == [("a", ["a0", "a1"]), ("b", ["b0", "b1"])]
    with pytest.raises(ValueError, match="disagree"):
        payloads_by_name([[("a", 0)], [("b", 1)]])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_missing_sglang_names_the_extra():
    with pytest.raises(ImportError, match=r"megarl\[sglang\]"):
        require_sglang()
