"""What `megarl convert mcore-to-hf` and `megarl export-hf` write loads in transformers as is:
config.json with architectures and dtype, generation_config.json with both EOS ids, the
tokenizer, bit-exact weights, and never the source directory's own weights. One small trained
Llama with its own tokenizer (tests/fixtures/hf_models.py), three single-process CLI calls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megarl.checkpoint.jobs import CONVERSION_RECORD
from megarl.config import load_config, to_yaml
from megarl.trainer.checkpoint import Checkpoints
from tests.fixtures.hf_models import EOS_IDS, IM_END_ID, PAD_ID, make_hf_model, make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
WEIGHTS = {"model-00001-of-00001.safetensors", "model.safetensors.index.json"}


def megarl(*args, cwd: Path = ROOT) -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    tokenizer = make_tokenizer(root / "tokenizer")
    make_hf_model("llama", root / "src", tokenizer)
    megarl("convert", "hf-to-mcore", root / "src", root / "mcore")
    return root


def check_loadable_export(out: Path, src: Path) -> None:
    """transformers loads ``out`` with its tokenizer; weights and logits equal the source's;
    greedy generation stops at an EOS id."""
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS_IDS
    exported, source = load_file(out / "model-00001-of-00001.safetensors"), load_file(src / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(exported[k].dtype == torch.float32 and torch.equal(exported[k], source[k]) for k in source)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert tok.eos_token_id == IM_END_ID and tok.pad_token_id == PAD_ID
    assert model.generation_config.eos_token_id == EOS_IDS
    reference = transformers.AutoModelForCausalLM.from_pretrained(src)
    ids = tok.apply_chat_template([{"role": "user", "content": "reverse 4821"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        new = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(new) < 24 and new[-1] in EOS_IDS and not set(new[:-1]) & set(EOS_IDS), new


def test_mcore_to_hf_writes_a_loadable_directory(work):
    out = work / "out"
    megarl("convert", "mcore-to-hf", work / "mcore", out)
    assert {p.name for p in out.iterdir()} == WEIGHTS | TOKENIZER_FILES | {"config.json", "generation_config.json",
                                                                         CONVERSION_RECORD}
    check_loadable_export(out, work / "src")


def test_export_hf_from_another_directory_never_copies_source_weights(work, tmp_path):
    """A run whose model.path is the HF source (which holds model.safetensors): the export has
    the converted shards only. Run from a directory that is not the run's."""
    run = tmp_path / "run"
    cfg = load_config([], [f"model.path={work / 'src'}", f"model.hf_config={work / 'src'}",
                           f"data.tokenizer={work / 'tokenizer'}"])
    Checkpoints(run).save(1, lambda tmp: shutil.copytree(work / "mcore", tmp / "actor"), {"step": 1}, to_yaml(cfg))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    megarl("export-hf", run, "exported", cwd=elsewhere)
    out = elsewhere / "exported"
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" not in names
    assert names == WEIGHTS | TOKENIZER_FILES | {"config.json", "generation_config.json"}
    check_loadable_export(out, work / "src")


def test_bare_megatron_checkpoint_as_model_path_takes_hf_config(work, tmp_path):
    """A dist checkpoint without megarl's hf/ folder (as Megatron-LM writes them) is accepted as
    model.path when model.hf_config and data.tokenizer say what it is, and refused by name when not."""
    from megarl.entrypoints.train_rl import prepare

    bare = tmp_path / "iter_0000001"
    shutil.copytree(work / "mcore", bare, ignore=shutil.ignore_patterns("hf"))
    base = [f"model.path={bare}", f"trainer.run_dir={tmp_path / 'run'}", "data.prompts_per_step=4",
            "algorithm.max_new_tokens=16"]
    with pytest.raises(ValueError, match="model.path=.*without its HF config"):
        prepare(load_config([], base))
    prepared = prepare(load_config([], base + [f"model.hf_config={work / 'src'}", f"data.tokenizer={work / 'src'}"]))
    assert prepared.cfg.model.path == str(bare) and prepared.tokenizer.vocab_size == 260
