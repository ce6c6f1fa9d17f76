"""The GPU-shaped harness sees the device faults of issue 24: the demo's RLWorker, verb by verb
at actor tp=2 (tests/distributed/gpu_shaped_worker.py), runs as written, and refuses each fault
put back: the batch's device move removed (finding 1), a CPU tensor in an NCCL collective
(finding 2), CPU generators for CUDA probabilities (finding 3), a module built on the CPU
(finding 5). Results come back to the host."""

import json

import pytest

from tests.distributed.launch import torchrun

pytestmark = pytest.mark.gpu_shaped
FAULTS = {"fault/batch_not_moved": "embedding: expected all tensors to be on the same device",
          "fault/cpu_generators": "Expected a 'cuda' device type for generator but found 'cpu'",
          "fault/cpu_collective": "a cpu tensor of shape [15] on a NCCL group",
          "fault/value_head_on_cpu": "linear: expected all tensors to be on the same device"}


@pytest.fixture(scope="module")
def results(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("MEGARL_GPU_SHAPED", "1")
    out = torchrun(2, "tests/distributed/gpu_shaped_worker.py", str(tmp_path_factory.mktemp("gpu_shaped")))
    records = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    found = {r["case"]: r["error"] for r in records}
    found["vllm_details"] = next(r for r in records if r["case"] == "vllm")
    found["lora_details"] = next(r for r in records if r["case"] == "lora")
    found["delta_details"] = next(r for r in records if r["case"] == "delta")
    return found


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_verbs_run_on_the_device_as_written(results):
    fixed = {k: v for k, v in results.items() if k.startswith("fixed/")}
    assert set(fixed) == {"fixed/generate", "fixed/log_prob", "fixed/value_head", "fixed/vllm", "fixed/lora",
                          "fixed/delta"}
    assert all(v is None for v in fixed.values()), fixed


def test_vllm_gpu_path_on_the_device(results):
    """The vllm backend's GPU path (its engine a recording stand-in: vLLM's CPU build cannot be a
    CUDA engine): from the CUDA-shaped generation shard to the host file the engine reads, exactly
    the native rollout's weights by HF name; the engine gets its GPU keywords, sleeps while the
    trainer holds the device, wakes the weights before the sync and the KV cache after."""
    r = results["vllm_details"]
    assert r["error"] is None and r["responses"] == 6
    assert r["gpu_keywords"] == [True, 0.5] and r["weights_exact"] is True
    assert r["calls"] == ["reset_prefix_cache", "sleep1", "wake:weights", "reset_prefix_cache", "wake:kv_cache",
                          "generate"]


def test_lora_on_the_device(results):
    """LoRA's adapters live beside their base weights on the device; the actor updates them, the
    reference pass turns them off, and the sync's merged weights land on the device: the
    adapted projections move at every sync, the frozen rest (embedding, norms, output) once. The
    adapter sync's gather (an object all-gather over the NCCL-shaped world) brings them whole to
    the host."""
    r = results["lora_details"]
    assert r["error"] is None and r["adapters_on_device"] and r["synced_on_device"], r
    assert r["grad_norm"] > 0 and r["adapters_moved_log_probs"] > 0, r
    assert 0 < r["moved_again"] < r["moved"], r
    assert r["peft_tensors"] == 2 * 7 * 2 and r["peft_on_host"], r  # A and B of 7 parts, 2 layers


def test_delta_sync_on_the_device(results):
    """weight_sync=delta's encode and apply run on the device (the host fast paths refuse CUDA
    tensors), and after each step equal the full sync bit for bit, sending a fraction after the first."""
    r = results["delta_details"]
    assert r["error"] is None and r["on_device"] and all(r["equal"]), r
    assert r["fraction"][0] == 1.0 and all(0 < f < 0.5 for f in r["fraction"][1:]), r


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_each_fault_put_back_is_refused(results, case):
    assert results[case] is not None and FAULTS[case] in results[case], results[case]


def test_ray_less_loop_of_the_gpu_check(tmp_path):
    """benchmarks/gpu/check_loop.py, the GPU check's RL loop without Ray, under the harness at tp=2:
    PPO's roles with the trainer's state offloaded while generating, a checkpoint each step
    reloaded into the same weights."""
    env = {"MEGARL_GPU_SHAPED": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        out = torchrun(2, "benchmarks/gpu/check_loop.py", str(tmp_path), "trainer.train_steps=2",
                       "trainer.offload.params=true", "trainer.offload.grads=true", "trainer.offload.optimizer=true")
    rows = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("LOOP {")]
    assert "LOOP_OK" in out and len(rows) == 3
    assert rows[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and "critic/loss" in rows[0]
    assert rows[0]["rollout/logp_max_abs_diff"] <= 1e-2  # bf16, as on a GPU (tests/e2e/test_gpu_shaped.py)
