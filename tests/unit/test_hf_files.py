"""The side files of an exported HF directory: an allow-list (never weights), config.json's
``architectures`` and dtype, a generation config found or derived, the tokenizer's source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.hf_files import causal_lm_architecture, export_config, write_side_files

LLAMA = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": None, "dtype": "bfloat16",
         "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}


def fill(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text(json.dumps({"from": str(directory.name)}))
    return directory


@pytest.mark.parametrize("model_type, cls", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                             ("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                             ("mixtral", "MixtralForCausalLM"), ("mistral", "MistralForCausalLM"),
                                             ("qwen2_moe", "Qwen2MoeForCausalLM"), ("glm4_moe", "Glm4MoeForCausalLM"),
                                             ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_architecture_per_model_type(model_type, cls):
    assert causal_lm_architecture(model_type) == cls


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="model_type 'gpt9'"):
        causal_lm_architecture("gpt9")


def test_export_config_names_class_and_written_dtype():
    out = export_config(LLAMA, torch.float32)
    assert out["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in out
    assert out["dtype"] == out["torch_dtype"] == "float32"
    assert LLAMA["dtype"] == "bfloat16" and "auto_map" in LLAMA  # the source is left alone


def test_only_allowed_files_are_copied(tmp_path):
    source = fill(tmp_path / "src", "config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "model.safetensors.index.json",
                  "training_args.json", "trainer_state.json")
    for weights in ("model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin", "optimizer.pt",
                    "modeling_x.py"):
        (source / weights).write_bytes(b"\0" * 16)
    (source / "merges.txt").write_text("a b\n")
    dest = fill(tmp_path / "out")
    written = write_side_files(dest, LLAMA, torch.bfloat16, source, None)
    expected = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "merges.txt"}
    assert set(written) == expected and {p.name for p in dest.iterdir()} == expected
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((dest / "generation_config.json").read_text()) == {"from": "src"}


def test_tokenizer_dir_wins_and_generation_config_falls_back(tmp_path):
    config_dir = fill(tmp_path / "cfg", "config.json", "tokenizer.json")
    tokenizer_dir = fill(tmp_path / "tok", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    dest = fill(tmp_path / "out")
    write_side_files(dest, LLAMA, torch.float32, config_dir, tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert json.loads((dest / name).read_text()) == {"from": "tok"}, name


def test_generation_config_derived_from_the_config(tmp_path):
    dest = fill(tmp_path / "out")
    write_side_files(dest, LLAMA, torch.float32, fill(tmp_path / "cfg", "config.json"), None)
    assert json.loads((dest / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    dest = fill(tmp_path / "out2")
    no_eos = dict(LLAMA, eos_token_id=None)
    assert "generation_config.json" not in write_side_files(dest, no_eos, torch.float32, None, None)
