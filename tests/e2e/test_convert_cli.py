"""`megarl convert` on bad input: a non-zero exit, a message naming the tensor or field, and no
output directory (nor a leftover temporary one)."""

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
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "llama"
    config = json.loads((ROOT / "configs/models/tiny-llama.json").read_text())
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).save_pretrained(out)
    return out


def broken_copy(src: Path, dst: Path, edit_weights=None, edit_config=None) -> Path:
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    if edit_weights:
        edit_weights(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def convert(*args: str):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr


def assert_refused(rc: int, err: str, out: Path, *words: str) -> None:
    assert rc == 2, err[-3000:]
    for word in words:
        assert word in err, err[-3000:]
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()


def test_missing_tensor(llama, tmp_path):
    src = broken_copy(llama, tmp_path / "src",
                      edit_weights=lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    rc, err = convert("hf-to-mcore", str(src), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", "missing", "model.layers.1.self_attn.k_proj.weight",
                   "decoder.layers.1.self_attention.linear_qkv.weight")


def test_unexpected_tensor(llama, tmp_path):
    src = broken_copy(llama, tmp_path / "src",
                      edit_weights=lambda w: w.update({"model.layers.0.self_attn.rotary.inv_freq": torch.ones(8)}))
    rc, err = convert("hf-to-mcore", str(src), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", "unexpected", "model.layers.0.self_attn.rotary.inv_freq")


def test_unsupported_model_type(llama, tmp_path):
    src = broken_copy(llama, tmp_path / "src", edit_config=lambda c: c.update(model_type="gpt2"))
    rc, err = convert("hf-to-mcore", str(src), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", "model_type 'gpt2'", "llama")


def test_shape_mismatch(llama, tmp_path):
    def shrink(w):
        w["model.layers.2.mlp.down_proj.weight"] = w["model.layers.2.mlp.down_proj.weight"][:, :100].contiguous()
    src = broken_copy(llama, tmp_path / "src", edit_weights=shrink)
    rc, err = convert("hf-to-mcore", str(src), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", "model.layers.2.mlp.down_proj.weight", "[64, 100]", "[64, 128]")


@pytest.mark.parametrize("flags, words", [
    (["--tp", "3"], ["world size 1", "tp*pp*cp = 3"]),
    (["--nproc", "2", "--ep", "2"], ["ep=2", "no experts"]),
    (["--nproc", "2", "--pp", "2", "--vpp", "4"], ["num_layers = 4", "pp*vpp = 8"]),
])
def test_impossible_layout(llama, tmp_path, flags, words):
    rc, err = convert("hf-to-mcore", str(llama), str(tmp_path / "out"), *flags)
    assert_refused(rc, err, tmp_path / "out", *words)


def test_existing_output_is_never_overwritten(llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = convert("hf-to-mcore", str(llama), str(out))
    assert rc == 2 and "already exists" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_export_without_hf_config(tmp_path):
    rc, err = convert("mcore-to-hf", str(tmp_path), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", "not a Megatron dist checkpoint")


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_truncated_safetensors(llama, tmp_path):
    src = _copy_dir(llama, tmp_path / "src")
    weights = src / "model.safetensors"
    _truncate(weights, weights.stat().st_size - 1000)
    rc, err = convert("hf-to-mcore", str(src), str(tmp_path / "out"), "--nproc", "2")
    assert_refused(rc, err, tmp_path / "out", str(weights), "truncated", "tensor '")
    assert "Traceback" not in err


def test_corrupt_safetensors_header(llama, tmp_path):
    src = _copy_dir(llama, tmp_path / "src")
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"#garbage"  # the JSON header's first bytes
    weights.write_bytes(bytes(data))
    rc, err = convert("hf-to-mcore", str(src), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", str(weights), "corrupt safetensors header")


@pytest.fixture(scope="module")
def mcore(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mc") / "llama"
    rc, err = convert("hf-to-mcore", str(llama), str(out))
    assert rc == 0, err[-3000:]
    return out


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_truncated_distcp(mcore, tmp_path, nproc):
    ckpt = _copy_dir(mcore, tmp_path / "ckpt")
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _truncate(shard, shard.stat().st_size // 2)
    rc, err = convert("mcore-to-hf", str(ckpt), str(tmp_path / "out"), *nproc)
    assert_refused(rc, err, tmp_path / "out", str(shard), "truncated")
    assert "Traceback" not in err


def test_corrupt_distcp_bytes(mcore, tmp_path):
    """A .distcp of the right length with garbage inside: found while reading, named, no OUT.tmp."""
    ckpt = _copy_dir(mcore, tmp_path / "ckpt")
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    rc, err = convert("mcore-to-hf", str(ckpt), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", "reading '", str(ckpt))


def test_truncated_dist_metadata(mcore, tmp_path):
    ckpt = _copy_dir(mcore, tmp_path / "ckpt")
    _truncate(ckpt / ".metadata", 100)
    rc, err = convert("mcore-to-hf", str(ckpt), str(tmp_path / "out"))
    assert_refused(rc, err, tmp_path / "out", str(ckpt / ".metadata"), "unreadable")
