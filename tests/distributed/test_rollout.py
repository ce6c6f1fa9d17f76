"""Native rollout on CPU, fed by the 3D-HybridEngine: greedy decoding with the KV cache equals
greedy decoding by full recomputation; the trainer's log-probs of every response equal the
rollout's (max abs <= 1e-5, fp32: a PPO ratio of 1 at the first step); seeded sampling is
reproducible; stop tokens, max length, prompts of different lengths and n > 1 are reported;
released memory refuses to generate until resumed and re-synced. A bf16 rollout
(parallel.rollout.dtype) fed by fp32 training shards at tp=2 -> t_g=1 generates with bf16 weights and
activations, and its log-prob mismatch to the fp32 trainer is far above fp32's.

Every planned generation layout runs: MoE at t_g=2 (no sequence parallelism in the decode), MoE at
e_g=2 (replicas decode in lock-step; one replica's rows stop at once while the other's run on,
and at d_g=4 one replica has no rows at all), dense and MoE at p_g=2 (stage-to-stage decode).
Each MoE rollout records its routing: the fp32 trainer routes every token fed to the same experts.
gpt_oss (attention sinks, a window of 8 on every other layer: prompts of up to 10 tokens plus 8
new ones, biases, clamped SwiGLU) decodes at e_g=2 with the KV cache exactly as by recomputation;
so does Qwen3-Next (gated delta nets: each row's convolution and recurrent state in the decode
context, left-padded prompts, finished rows dropped) at t_g=2, e_g=2 and p_g=2.

The rollout-backend contract (test_rollout_backend_contract): every backend of the registry that
runs here, native and SGLang through its recording stand-in, built by the registry and driven by
the Rollout role through the same two loop steps, in the SGLang cases' layouts, one of them
(``smollm``) a tied model at a real small model's widths (SmolLM-135M's: hidden 576, 9 heads of 64,
3 KV heads, vocabulary 49152; 4 layers) at tp=1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import torchrun

WORKER = "tests/distributed/rollout_worker.py"
TOL = 1e-5
CASES = {  # world size -> model@t,p,d,e>t_g,e_g[,p_g][+bf16]
    2: ["llama@2,1,1,1>1,1+bf16", "llama@2,1,1,1>2,1+sglang", "qwen3-moe@2,1,1,1>2,1", "qwen3-moe@1,1,2,2>1,2",
        "llama@1,2,1,1>1,1,2", "qwen3-moe@1,2,1,1>1,1,2", "gpt-oss@1,1,2,2>1,2",
        "qwen3-next@2,1,1,1>2,1", "qwen3-next@1,1,2,2>1,2", "qwen3-next@1,2,1,1>1,1,2",
        "smollm@1,1,2,1>1,1+sglang"],  # tied embeddings at SmolLM-135M's widths (rollout_worker.TIED)
    4: ["llama@2,2,1,1>1,1+sglang", "llama@2,1,2,1>2,1", "qwen3-moe@2,1,2,2>1,1+sglang", "deepseek@2,1,2,1>1,1",
        "qwen3-moe@1,1,4,2>1,2"],
}
SGLANG = [c.partition("+")[0] for cases in CASES.values() for c in cases if c.endswith("+sglang")]
# the backend contract runs in the SGLang cases with one generation pipeline stage (sglang_worker.contract)
CONTRACT = [c for c in SGLANG if len(c.split(">")[1].split(",")) == 2]
ALL = [c.partition("+")[0] for cases in CASES.values() for c in cases]  # "+bf16": an extra check


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("rollout")
    torchrun(1, WORKER, "reference", str(work), "llama", "qwen3-moe", "deepseek", "gpt-oss", "qwen3-next", "smollm")
    out = {}
    for world, cases in CASES.items():
        for line in torchrun(world, WORKER, "run", str(work), *cases).splitlines():
            if line.startswith("RESULT "):
                record = json.loads(line[7:])
                out[record["case"]] = record
    return out


def test_bf16_rollout_from_fp32_training(results):
    """Measured: bf16 mismatch 3.0e-3 against 9.5e-7 in fp32 (tiny Llama, T=0.8)."""
    r = results["llama@2,1,1,1>1,1"]
    assert r["bf16_train_dtypes"] == ["torch.float32"] and r["bf16_weight_dtypes"] == ["torch.bfloat16"]
    assert r["bf16_cast_exact"]  # each generation weight is its fp32 training value rounded to bf16
    assert r["bf16_layer_output_dtypes"] == ["torch.bfloat16"]  # the layers compute in bf16
    assert r["bf16_samples"] == 15
    assert r["sampled_logp_diff"] <= TOL < 1e-4 < r["bf16_sampled_logp_diff"] < 0.1


@pytest.mark.parametrize("case", ALL)
def test_greedy_equals_full_recomputation(results, case):
    r = results[case]
    assert all(r["greedy_equal"]), r["greedy_equal"]
    assert all(r["recompute_equal"]) and r["recompute_logp_diff"] <= TOL  # the no-cache baseline
    assert r["greedy_finish"] == ["length"] * 5
    assert r["policy_versions"] == [1]


@pytest.mark.parametrize("case", ALL)
def test_decode_fast_paths_are_taken(results, case):
    """Every standard attention layer keeps rotated keys in the decode's own cache (MLA keeps
    Megatron's), and at t_g = 1 every linear layer runs as a plain matmul; the tests above check
    that both leave the tokens and log-probs as they were."""
    r = results[case]
    rotated, attention = r["rotated_kv_layers"]
    assert rotated == attention and (attention > 0) == (not case.startswith("deepseek"))
    plain, linears = r["plain_linears"]
    assert linears > 0 and plain == (linears if case.split(">")[1].startswith("1,") else 0)


@pytest.mark.parametrize("case", ALL)
def test_trainer_log_probs_equal_rollout_log_probs(results, case):
    r = results[case]
    assert r["greedy_logp_diff"] <= TOL
    assert r["sampled_logp_diff"] <= TOL  # at temperature 0.8 with top-p/top-k sampling


@pytest.mark.parametrize("case", ALL)
def test_stop_tokens_and_finish_reasons(results, case):
    r = results[case]
    assert all(r["stop_equal"])
    assert all(got == want for got, want in r["stop_finish"])
    assert any(got == "stop" for got, _ in r["stop_finish"]) and any(got == "length" for got, _ in r["stop_finish"])


EXPERT_PARALLEL = [c for c in ALL if int((c.split(">")[1] + ",1").split(",")[1]) > 1]
MOE = [c for c in ALL if not c.startswith(("llama", "smollm"))]


@pytest.mark.parametrize("case", EXPERT_PARALLEL)
def test_expert_parallel_replicas_finish_at_different_steps(results, case):
    """Stop tokens end the first replica's rows after one token while its expert-group partner
    decodes on (pad rows keep the first in the group's collectives); the tokens are still the
    greedy ones and the log-probs the trainer's."""
    r = results[case]
    assert all(r["early_equal"]), r["early_equal"]
    first = r["early_replica_rows"][0]
    assert r["early_lengths"][:first] == [1] * first and max(r["early_lengths"][first:]) == 8
    assert r["early_logp_diff"] <= TOL
    if case == "qwen3-moe@1,1,4,2>1,2":  # 5 prompts over 4 replicas: the last has none
        assert r["early_replica_rows"] == [2, 2, 1, 0]


@pytest.mark.parametrize("case", MOE)
def test_recorded_routing_is_the_trainers(results, case):
    """Response.routing: one top-k set per MoE layer for every position fed (gathered over the
    stages at p_g > 1); the fp32 trainer routes every such token to the same experts."""
    r = results[case]
    assert r["routing_shapes_ok"] and r["routing_mismatch"] == 0.0


@pytest.mark.parametrize("case", ALL)
def test_sampling_n_and_seed(results, case):
    r = results[case]
    assert r["samples"] == 15  # 5 prompts x n=3, prompt-major
    assert r["sample_order"] == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert r["reproducible"] and r["distinct_samples"] > 10


def test_samples_do_not_depend_on_the_layout(results):
    """Each sample's random stream depends only on (seed, prompt, sample): t_g=1 and t_g=2 draw
    the same tokens from the same weights."""
    assert results["llama@2,1,1,1>1,1"]["sampled_tokens"] == results["llama@2,1,1,1>2,1"]["sampled_tokens"]


@pytest.mark.parametrize("case", ALL)
def test_partial_rollout_across_a_weight_sync(results, case):
    """A partial rollout (begin, advance 3 tokens, a sync of moved weights, advance to the end) at
    every generation layout: each token carries the policy version that sampled it, and its
    log-prob equals the trainer's under that version's weights (fp32, <= 1e-5) when the KV cache
    is recomputed after the sync. Then greedy continuations equal a fresh generation from the same
    prefixes under the new weights; rows that stopped before the sync are returned by the first
    call. With the cache kept, the tokens before the sync still match, those after do not (the
    keys of the old weights stay: the behaviour policy is a mixture, and its log-probs are what
    the engine sampled with)."""
    r = results[case]
    assert r["partial_in_flight"] == 10  # 5 prompts x 2 samples, none stopped before the sync
    assert r["partial_versions"] == [[1, 1, 1, 3, 3, 3, 3, 3]] and r["partial_policy_versions"] == [1]
    assert max(r["partial_logp_diff"].values()) <= TOL, r["partial_logp_diff"]
    assert r["partial_early_rows"] >= 1 and r["partial_fresh_equal"] and all(r["partial_fresh_equal"])
    assert r["partial_fresh_logp_diff"] <= TOL
    kept = r["kept_logp_diff"]
    assert kept["1"] <= TOL < 1e-3 < kept["3"], kept


@pytest.mark.parametrize("case", ALL)
def test_release_and_resume(results, case):
    r = results[case]
    assert r["released_refuses"] and r["resumed_same"]


# ----------------------------------------------------------------------------- the SGLang adapter (sglang_worker.py)
WEIGHTS, GENERATION = ["weights"], ["kv_cache", "cuda_graph"]


@pytest.mark.parametrize("case", SGLANG)
def test_sglang_colocated_call_order(results, case):
    """Per step: weights back (trainer resident) -> buckets -> flush -> trainer offloaded -> KV cache
    back -> generate -> everything released; the first sync starts with the KV cache released."""
    r = results[case]
    assert r["sglang_start"] == ["start", "dummy", True, int(case.split(">")[1].split(",")[0])]
    step = r["sglang_step_log"]
    tensor_calls = [e for e in step if e[0] == "update_weights_from_tensor"]
    assert tensor_calls and all(e == ["update_weights_from_tensor", False] for e in tensor_calls)
    n = len(tensor_calls)
    assert step[0] == ["resume", WEIGHTS, False] and step[1:n + 1] == tensor_calls
    assert step[n + 1:n + 3] == [["flush_cache"], ["resume", GENERATION, True]]
    world = next(w for w, cases in CASES.items() if case + "+sglang" in cases)
    gen_dp = world // int(case.split(">")[1].split(",")[0])
    assert step[n + 3] == ["generate", 4 // gen_dp, True]  # this replica's share of 2 prompts x n=2
    assert step[-1] == ["release", WEIGHTS + GENERATION, True]
    first = r["sglang_first_log"]
    assert first[0] == ["update_weights_from_tensor", False] and ["resume", GENERATION, True] in first
    assert r["sglang_reloaded"]
    assert r["sglang_responses"] == [[0, 0, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1]]


@pytest.mark.parametrize("case", SGLANG)
def test_sglang_payloads_are_the_hf_export(results, case):
    r = results[case]
    assert r["sglang_names_equal"] and r["sglang_payloads_exact"]


@pytest.mark.parametrize("case", SGLANG)
def test_sglang_engine_env_and_ipc_devices(results, case):
    """The engine's processes start without torchrun's agent-store variable (their rendezvous
    hosts its own store), and every CUDA-IPC handle opens on the GPU its tensor lives on in the TP
    worker that takes it (by the GPU's uuid: each worker's own device ordinal is 0)."""
    r = results[case]
    assert r["sglang_engine_store_env"] is None
    assert r["sglang_ipc_handles"] > 0 and r["sglang_ipc_wrong_gpu"] == []


@pytest.mark.parametrize("case", SGLANG)
def test_sglang_split_broadcast_is_the_hf_export(results, case):
    """Every planned tensor arrives at the receiver bit-identical to the HF export; rank 0
    broadcasts each byte of the model once; buckets of several tensors stay within the budget."""
    r = results[case]
    assert r["broadcast_names_equal"] and r["broadcast_exact"]
    assert r["broadcast_sent"][0] == r["broadcast_model_bytes"]
    assert r["broadcast_buckets"] > 2 and r["broadcast_max_bucket"] <= 48 << 10


def test_expert_parallel_generation_needs_the_alltoall_dispatcher():
    """The replicas of an expert group feed different token counts; allgather needs equal ones."""
    from megarl.config import ModelConfig
    from megarl.hybrid import regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout
    from megarl.rollout.native import NativeRollout

    path = str(Path(__file__).resolve().parents[2] / "configs/models/tiny-qwen3-moe.json")
    args = megatron_args_from_hf(path)
    rg = regroup(Layout(dp=2, ep=2, etp=1), 1, 1, 2, args.num_experts)
    with pytest.raises(ValueError, match="rollout.ep=2 needs model.moe_token_dispatcher=alltoall"):
        NativeRollout.colocated(ModelConfig(hf_config=path, moe_token_dispatcher="allgather"), args, rg)


@pytest.mark.parametrize("case", CONTRACT)
@pytest.mark.parametrize("backend", ["native", "sglang"])
def test_rollout_backend_contract(results, case, backend):
    """Every backend in megarl.rollout.backends.ROLLOUT_BACKENDS that runs here (a new one joins
    the list above), built through the registry and driven by the Rollout role through two loop
    steps: n samples per prompt in order with the last sync's version; the trainer's parameters off
    the device while it generates and back afterwards; exactly the trainer's weights after a sync."""
    from megarl.rollout.backends import ROLLOUT_BACKENDS

    # add a new backend to this test; vLLM's contract is tests/distributed/test_vllm_contract.py
    assert sorted(map(str, ROLLOUT_BACKENDS)) == ["native", "sglang", "vllm"]
    c = results[case]["contract"][backend]
    assert c["order"] == [[0, 0], [0, 1], [1, 0], [1, 1]] and c["versions"] == [1]
    assert c["offloaded_while_generating"] == [True, True] and c["trainer_back"]
    assert c["weights_exact"] is True
