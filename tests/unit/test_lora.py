"""megarl.models.lora's pure parts: target names, the refusals made before anything starts, and
PEFT adapter files (the adapters' numbers: tests/distributed/test_lora.py, tests/e2e/test_lora.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megarl.config.schema import LoRAConfig
from megarl.models import lora
from megarl.models.hf_config import megatron_args_from_hf


def test_targets_take_megatron_and_hf_names():
    assert lora.target_parts(["linear_qkv"]) == {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj")}
    assert lora.target_parts(["v_proj", "q_proj", "down_proj"]) == {
        "self_attention.linear_qkv": ("q_proj", "v_proj"), "mlp.linear_fc2": ("down_proj",)}
    with pytest.raises(lora.LoRAError, match="'lm_head' is not a LoRA target"):
        lora.target_parts(["lm_head"])


def test_routed_experts_and_mla_are_refused_by_name():
    moe = megatron_args_from_hf("configs/models/tiny-qwen3-moe.json")
    lora.check_targets(LoRAConfig(rank=8, target_modules=["linear_qkv", "o_proj"]), moe)
    with pytest.raises(lora.LoRAError, match="routed experts is not built yet; target attention only"):
        lora.check_targets(LoRAConfig(rank=8, target_modules=["gate_proj"]), moe)
    mla = megatron_args_from_hf("configs/models/tiny-deepseek-v3.json")
    with pytest.raises(lora.LoRAError, match="MLA attention is not built yet"):
        lora.check_targets(LoRAConfig(rank=8, target_modules=["linear_qkv"]), mla)
    for name in ("tiny-qwen3-next", "tiny-qwen3-5-moe"):
        hybrid = megatron_args_from_hf(f"configs/models/{name}.json")
        with pytest.raises(lora.LoRAError, match="gated delta nets .* have no LoRA layout"):
            lora.check_targets(LoRAConfig(rank=8, target_modules=["linear_qkv"]), hybrid)


def test_interleave_places_parts_per_query_group():
    layout = lora.PartLayout(groups=2, rows=(2, 1, 1))  # per group: q q k v
    q = torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # group 0: 1 2, group 1: 3 4
    v = torch.tensor([[7.0], [8.0]])
    out = lora._interleave({0: q, 2: v}, layout, 0, torch.empty(8, 1))
    assert out.flatten().tolist() == [1, 2, 0, 7, 3, 4, 0, 8]


def adapter_dir(tmp_path, **config):
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (tmp_path / lora.ADAPTER_CONFIG).write_text(json.dumps(base | config))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8)},
              str(tmp_path / lora.ADAPTER_WEIGHTS))
    return tmp_path


def test_a_peft_adapter_sets_rank_alpha_and_targets(tmp_path):
    cfg = lora.resolve(LoRAConfig(path=str(adapter_dir(tmp_path))))
    assert (cfg.rank, cfg.alpha, cfg.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    with pytest.raises(lora.LoRAError, match="model.lora.rank=16 but the adapter at model.lora.path has r=4"):
        lora.resolve(LoRAConfig(rank=16, path=str(tmp_path)))


@pytest.mark.parametrize("config,message", [
    ({"use_dora": True}, "use_dora=True; megarl's LoRA loads use_dora=False only"),
    ({"bias": "all"}, "bias='all'"),
    ({"target_modules": ".*proj"}, "target_modules is a pattern"),
    ({"target_modules": ["lm_head"]}, r"target_modules \['lm_head'\] are not LoRA targets"),
])
def test_adapters_megarl_cannot_reproduce_are_refused(tmp_path, config, message):
    with pytest.raises(lora.LoRAError, match=message):
        lora.read_peft_adapter(adapter_dir(tmp_path, **config))


def test_a_directory_without_adapter_files_is_named(tmp_path):
    with pytest.raises(lora.LoRAError, match="adapter_config.json is missing"):
        lora.read_peft_adapter(tmp_path)


def test_modules_trained_whole(tmp_path):
    assert lora.saved_modules(["model.norm", "final_layernorm"]) == ("decoder.final_layernorm",)
    with pytest.raises(lora.LoRAError, match=r"modules_to_save: \['lm_head'\] cannot be trained beside the adapters"):
        lora.saved_modules(["lm_head"])
    cfg = lora.resolve(LoRAConfig(path=str(adapter_dir(tmp_path, modules_to_save=["model.norm"]))))
    assert cfg.modules_to_save == ["final_layernorm"]
    with pytest.raises(lora.LoRAError, match=r"modules_to_save \['norm'\]"):  # PEFT's suffix match: every norm
        lora.read_peft_adapter(adapter_dir(tmp_path, modules_to_save=["norm"]))
