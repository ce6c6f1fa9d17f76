"""Mapping tables: transforms are exact inverses, and every architecture's table names exactly
the tensors transformers writes on disk (the contract a new table entry must pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from megarl.models.hf_config import megatron_args_from_hf
from megarl.models.hf_mapping import (
    SUPPORTED, ConversionError, GateUp, QKV, StackedExperts, VocabPad, build_plan, check_names, skipped_hf_names,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FOR = {"llama": "tiny-llama", "mistral": "tiny-mistral", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3",
              "mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe", "qwen2_moe": "tiny-qwen2-moe",
              "deepseek_v3": "tiny-deepseek-v3", "glm4_moe": "tiny-glm4-moe",
              "gpt_oss": "tiny-gpt-oss", "qwen3_next": "tiny-qwen3-next", "qwen3_5_moe_text": "tiny-qwen3-5-moe"}


@pytest.mark.parametrize("shape", [(48, 8), (48,)])
def test_qkv_groups_queries_with_their_keys_and_values(shape):
    heads, groups, head_dim = 4, 2, 4  # 2 query heads per group
    q = torch.randn(heads * head_dim, *shape[1:])
    k = torch.randn(groups * head_dim, *shape[1:])
    v = torch.randn(groups * head_dim, *shape[1:])
    t = QKV(heads, groups, head_dim)
    fused = t.to_mcore([q, k, v])
    # group 0 = q heads 0-1, then k head 0, then v head 0
    assert torch.equal(fused[:8], q[:8]) and torch.equal(fused[8:12], k[:4]) and torch.equal(fused[12:16], v[:4])
    assert torch.equal(fused[16:24], q[8:16])
    # a tensor-parallel split of the fused rows is whole groups: the split of a 1-group model
    half = QKV(heads // 2, groups // 2, head_dim).to_mcore([q[8:], k[4:], v[4:]])
    assert torch.equal(fused.chunk(2)[1], half)
    assert all(torch.equal(a, b) for a, b in zip(t.to_hf(fused), [q, k, v]))


def test_gate_up_and_vocab_padding_are_exact_inverses():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fused = GateUp().to_mcore([gate, up])
    assert torch.equal(fused, torch.cat([gate, up])) and all(
        torch.equal(a, b) for a, b in zip(GateUp().to_hf(fused), [gate, up]))
    emb = torch.randn(250, 4)
    padded = VocabPad(250, 256).to_mcore([emb])
    assert padded.shape == (256, 4) and torch.equal(padded[250:], torch.zeros(6, 4))
    assert torch.equal(VocabPad(250, 256).to_hf(padded)[0], emb)
    with pytest.raises(ConversionError, match="251 rows"):
        VocabPad(250, 256).to_mcore([torch.randn(251, 4)])


def test_stacked_experts_deinterleave_gate_up_and_are_exact_inverses():
    """GptOss: x @ gate_up_proj[e] alternates gate and up columns; Megatron's linear_fc1 of
    expert e computes x @ fc1.T = [gate, up]. Any leading slice of experts converts alike."""
    experts, hidden, inter = 3, 5, 4
    torch.manual_seed(0)
    w, b = torch.randn(experts, hidden, 2 * inter), torch.randn(experts, 2 * inter)
    x = torch.randn(7, hidden)
    fc1 = StackedExperts(transpose=True, interleaved=True).to_mcore([w])
    bias = StackedExperts(interleaved=True).to_mcore([b])
    assert fc1.shape == (experts, 2 * inter, hidden) and bias.shape == (experts, 2 * inter)
    for e in range(experts):
        hf = x @ w[e] + b[e]
        mc = x @ fc1[e].T + bias[e]
        assert torch.allclose(mc[:, :inter], hf[:, ::2], atol=1e-6) and torch.allclose(mc[:, inter:], hf[:, 1::2], atol=1e-6)
    assert torch.equal(StackedExperts(transpose=True, interleaved=True).to_mcore([w[1:2]])[0], fc1[1])
    assert torch.equal(StackedExperts(transpose=True, interleaved=True).to_hf(fc1)[0], w)
    assert torch.equal(StackedExperts(interleaved=True).to_hf(bias)[0], b)
    down = torch.randn(experts, inter, hidden)
    fc2 = StackedExperts(transpose=True).to_mcore([down])
    assert torch.equal(fc2[2], down[2].T) and torch.equal(StackedExperts(transpose=True).to_hf(fc2)[0], down)


def test_every_architecture_has_a_config_here():
    assert set(SUPPORTED) == set(CONFIG_FOR)


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_table_names_exactly_what_transformers_writes(model_type, tmp_path):
    config = json.loads((ROOT / "configs/models" / f"{CONFIG_FOR[model_type]}.json").read_text())
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        on_disk = set(f.keys())
    plan = build_plan(megatron_args_from_hf(config), vocab_multiple=128)
    assert set(plan.hf_names()) == on_disk
    assert len(plan.hf_names()) == len(on_disk)  # no HF tensor feeds two Megatron tensors


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_mtp_layers_are_skipped_and_names_checked(name):
    config = json.loads((ROOT / f"configs/models/{name}.json").read_text())
    args = megatron_args_from_hf(config)
    plan = build_plan(args, 128)
    mtp = ["model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.mlp.gate.weight",
           "model.layers.4.shared_head.norm.weight"]
    names = plan.hf_names() + mtp
    skipped = skipped_hf_names(args, names)
    assert skipped == mtp
    check_names(plan, names, skipped, "ckpt")  # accepted
    with pytest.raises(ConversionError, match="unexpected.*model.layers.4.eh_proj.weight"):
        check_names(plan, names, [], "ckpt")
