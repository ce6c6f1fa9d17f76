"""``model.path`` pre-flight: a broken pretrained checkpoint stops ``megarl train`` with exit 2,
naming the file or tensor, before Ray or any worker starts; a sound sharded one passes, and the
run's config holds absolute paths with the model config and tokenizer taken from model.path."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.cli import main
from megarl.config import load_config
from megarl.entrypoints.train_rl import prepare
from tests.fixtures.hf_models import make_hf_model, make_tokenizer

DEMO = "configs/grpo_demo.yaml"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny Llama saved in three safetensors shards with an index, plus its tokenizer."""
    work = tmp_path_factory.mktemp("model_path")
    tokenizer = make_tokenizer(work / "tokenizer")
    model = make_hf_model("llama", work / "single", tokenizer, train_steps=0)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model)
    hf.save_pretrained(work / "llama", max_shard_size="60KB")
    for f in model.iterdir():
        if not f.name.startswith("model") and f.is_file():
            shutil.copy2(f, work / "llama" / f.name)
    assert len(list((work / "llama").glob("*.safetensors"))) >= 3
    return work / "llama"


def broken(sharded: Path, tmp_path: Path, how: str) -> Path:
    out = tmp_path / how
    shutil.copytree(sharded, out)
    shard = sorted(out.glob("*.safetensors"))[1]
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "shape":
        config = json.loads((out / "config.json").read_text())
        config["intermediate_size"] += 64
        (out / "config.json").write_text(json.dumps(config))
    elif how == "dtype":
        tensors = load_file(shard)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].to(torch.int8)
        save_file(tensors, shard, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("how, named", [
    ("missing", "model-00002-of-"), ("truncated", "model-00002-of-"), ("shape", "intermediate_size|has shape"),
    ("dtype", "I8"),
])
def test_broken_checkpoint_exits_2_before_ray(sharded, tmp_path, capsys, how, named):
    import ray

    path = broken(sharded, tmp_path, how)
    code = main(["train", DEMO, f"model.path={path}", "model.hf_config=null", f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.path" in err and re.search(named, err), err
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_sound_checkpoint_resolves_config_tokenizer_and_absolute_paths(sharded, monkeypatch, tmp_path):
    monkeypatch.chdir(sharded.parent)
    cfg = load_config([Path(__file__).parents[2] / DEMO],
                      [f"model.path={sharded.name}", "model.hf_config=null", "trainer.run_dir=run"])
    prepared = prepare(cfg)
    c = prepared.cfg
    assert c.model.path == str(sharded) and c.model.hf_config == str(sharded) and c.data.tokenizer == str(sharded)
    assert c.trainer.run_dir == str(sharded.parent / "run")
    assert prepared.tokenizer.vocab_size == 260  # the model's own tokenizer, not the built-in one


def test_reward_model_must_read_the_policys_token_ids(sharded, tmp_path):
    """An HF reward model whose vocabulary is smaller than the policy's tokenizer is refused before
    any worker starts; one with the policy's vocabulary passes the pre-flight."""
    import transformers

    def reward_model(vocab: int) -> Path:
        config = json.loads((sharded / "config.json").read_text())
        config.update(vocab_size=vocab, num_labels=1, architectures=["LlamaForSequenceClassification"],
                      pad_token_id=0, eos_token_id=1)
        torch.manual_seed(0)
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**config))
        model.save_pretrained(tmp_path / f"rm{vocab}")
        return tmp_path / f"rm{vocab}"

    base = [f"model.path={sharded}", "model.hf_config=null", f"trainer.run_dir={tmp_path / 'run'}",
            "algorithm.reward_fn=model"]
    with pytest.raises(ValueError, match="reward model's vocab_size is 128 but the policy's tokenizer has 260"):
        prepare(load_config([DEMO], base + [f"reward_model.path={reward_model(128)}"]))
    prepared = prepare(load_config([DEMO], base + [f"reward_model.path={reward_model(260)}"]))
    assert prepared.cfg.reward_model.hf_config == str(tmp_path / "rm260")


@pytest.mark.parametrize("overrides, named", [
    (["model.path=null", "model.hf_config=configs/models/tiny-digits.json"], "set model.path"),
    (["parallel.rollout.lora_sync=adapter"], "engine=native does not serve LoRA adapters"),
    (["parallel.rollout.lora_sync=adapter", "parallel.rollout.engine=vllm", "trainer.placement=split",
      "parallel.rollout.nproc=1"], "lora_sync=adapter with trainer.placement=split is not built yet"),
    (["parallel.rollout.lora_sync=adapter", "parallel.rollout.engine=vllm", "model.lora.modules_to_save=[model.norm]"],
     "lora_sync=adapter with model.lora.modules_to_save"),
    (["model.lora.target_modules=[lm_head]"], "'lm_head' is not a LoRA target"),
    (["model.lora.path=DIR/none"], "adapter_config.json is missing"),
])
def test_lora_settings_that_cannot_run_exit_2_before_ray(sharded, tmp_path, capsys, overrides, named):
    import ray

    overrides = [o.replace("DIR", str(tmp_path)) for o in overrides]
    code = main(["train", DEMO, f"model.path={sharded}", "model.hf_config=null", "model.lora.rank=8",
                 f"trainer.run_dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err, err
    assert not ray.is_initialized() and not (tmp_path / "run").exists()
