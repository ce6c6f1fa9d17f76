"""``megarl train`` through the GPU-shaped harness (megarl.testing.gpu_shaped, MEGARL_GPU_SHAPED=1):
the CUDA code paths of every role on CPU, with CUDA torch's and NCCL's device rules enforced, so a
CPU tensor where a GPU run needs a CUDA one (or the reverse) fails here as it would there.

One session each: GRPO at actor tp=2 → rollout t_g=1 (colocated resharder, native sampling, the
weights checksum); PPO at pp=2 with critic, reference and reward model, saving every step and
resuming; ReMax (greedy and sampled generation) on a MoE model with gated delta nets (Qwen3-Next)
loaded from a Hugging Face directory at ep=2; split placement (the cross-world transfer); a train-lm step. The driver runs
outside the harness, as a GPU-less head node would: a worker result left on the device would fail
to unpickle there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.hf_models import chat_examples, make_hf_model, make_tokenizer
from tests.ray_cluster import joined

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs/grpo_demo.yaml")
pytestmark = pytest.mark.gpu_shaped


def megarl(*args: str, cwd: Path, timeout: int = 600, gpu_shaped: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MLFLOW_DISABLE_TELEMETRY="true", RAY_AUTH_MODE="disabled")
    env.pop("MEGARL_GPU_SHAPED", None)
    if gpu_shaped:
        env["MEGARL_GPU_SHAPED"] = "1"
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args, *joined(args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def train(run_dir: Path, *overrides: str, config: str = DEMO, gpu_shaped: bool = True) -> list:
    proc = megarl("train", config, f"trainer.run_dir={run_dir}", "logging.progress_bar=false", "logging.backends=[console]",
                  *overrides, cwd=ROOT, gpu_shaped=gpu_shaped)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DeviceMismatch" not in proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the workers ran under the harness exactly when asked: only there do they see a CUDA device
    assert all(("memory/worker_peak_gpu_gb" in r) == gpu_shaped for r in rows), rows[0].keys()
    return rows


# With CUDA, ``model.params_dtype=auto`` is bf16 (8 mantissa bits, a relative step of 3.9e-3): the
# KV-cached decode and the trainer's full forward round differently, 2e-3 to 4e-3 on log-probs of
# magnitude 1-3 (measured). fp32 gives the CPU tests' bound.
BF16_LOGP = 1e-2
FP32_LOGP = 1e-5


def first_step_agrees(row: dict, bound: float = BF16_LOGP) -> None:
    """The rollout's log-probs are the trainer's; the first PPO ratio is 1 (old log-probs are the trainer's)."""
    assert row["rollout/logp_max_abs_diff"] <= bound
    assert row["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """HF directories as a user brings them (a dense Llama and a Qwen3-Next: MoE with a gated
    shared expert, gated delta nets and gated attention), and chat prompts."""
    work = tmp_path_factory.mktemp("user_models")
    tokenizer = make_tokenizer(work / "tokenizer")
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c[:1], "answer": c[1]["content"]}) + "\n"
                            for c in chat_examples(8, seed=7)))
    return {"llama": make_hf_model("llama", work / "llama", tokenizer, train_steps=5),
            "moe": make_hf_model("qwen3_next", work / "moe", tokenizer, train_steps=5), "data": data}


def user_config(path: Path, model: Path, data: Path, actor: str, rollout: str, algorithm: str, extra: str = "") -> str:
    path.write_text(extra + f"""
model: {{path: {model}, params_dtype: float32}}
parallel: {{actor: {actor}, rollout: {rollout}}}
optimizer: {{lr: 1.0e-3}}
data: {{train_files: [{data}], prompts_per_step: 4}}
algorithm: {{name: {algorithm}, samples_per_prompt: 2, reward_fn: exact_match, max_new_tokens: 8}}
trainer: {{train_steps: 2, save_interval: 0, nproc_per_node: 2}}
""")
    return str(path)


def test_grpo_colocated_tp2_equals_cpu_mode(tmp_path, user_models):
    """From the same HF weights in fp32, the CUDA code paths compute what CPU mode computes (the
    harness's storage is the CPU's; its CUDA generators draw CPU streams): the same rewards, the
    same log-probs and the same final weights. The rewards add an LLM judge's (the same Llama,
    reward_model.generative, its engine resharded from tp=2 to t_g=1 on the "device"; the score
    its judgement's length, read by a parser function in the reward workers) to the rule's."""
    judge = (f"reward_model: {{path: {user_models['llama']}, generative: true, template: 'reverse {{response}}', "
             f"parser: 'tests.fixtures.judge_parsers:length', max_new_tokens: 4, rule_weight: 1.0}}\n")
    config = user_config(tmp_path / "grpo.yaml", user_models["llama"], user_models["data"], "{tp: 2}", "{tp: 1}",
                         "grpo", extra=judge)
    rows = train(tmp_path / "run", config=config)
    cpu = train(tmp_path / "cpu", config=config, gpu_shaped=False)
    assert len(rows) == 2
    first_step_agrees(rows[0], FP32_LOGP)
    assert rows[0]["time/weight_sync_s"] > 0
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in cpu]
    assert [r["reward/judge_score_mean"] for r in rows] == [r["reward/judge_score_mean"] for r in cpu]
    assert all(r["reward/judge_unparseable"] == 0 and r["reward/judge_score_mean"] > 0 for r in rows)
    assert rows[1]["actor/ratio_mean"] == pytest.approx(cpu[1]["actor/ratio_mean"], abs=1e-6)
    final, final_cpu = (json.loads((tmp_path / d / "final.json").read_text()) for d in ("run", "cpu"))
    assert final["step"] == 2
    assert final["actor_weights_checksum"] == pytest.approx(final_cpu["actor_weights_checksum"], rel=1e-6)


def test_ppo_pp2_critic_reference_reward_model_save_and_resume(tmp_path):
    from tests.distributed.launch import torchrun

    torchrun(1, "tests/distributed/reward_model_worker.py", "reference", str(tmp_path))  # CPU mode: the RM checkpoint
    args = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.samples_per_prompt=2", "parallel.actor.tp=1",
            "parallel.actor.pp=2", "trainer.save_interval=1", "algorithm.reward_fn=model",
            f"reward_model.checkpoint={tmp_path / 'rm'}", "reward_model.hf_config=configs/models/tiny-llama.json")
    run = tmp_path / "run"
    rows = train(run, "trainer.train_steps=2", *args)
    first_step_agrees(rows[0])
    assert rows[0]["reward/max"] != rows[0]["reward/min"]  # the reward model scored on the "device"
    assert "critic/loss" in rows[0] and math.isfinite(rows[0]["critic/loss"])
    proc = megarl("train", DEMO, f"trainer.run_dir={run}", "logging.progress_bar=false", "logging.backends=[console]",
                  "trainer.train_steps=3", *args, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "resuming after step 2" in proc.stdout + proc.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_remax_moe_ep2_from_hf_directory(tmp_path, user_models):
    """A MoE checkpoint the user brings (HF directory, a Qwen3-Next) at actor ep=2 (dp=2) →
    rollout e_g=2: the loader, greedy and sampled generation (the gated delta nets' decode state
    on the device), the alltoall dispatcher's device-to-host split sizes, routing recorded on the
    device, PPO mini-batches gathered over dp."""
    config = user_config(tmp_path / "moe.yaml", user_models["moe"], user_models["data"], "{tp: 1, ep: 2}",
                         "{tp: 1, ep: 2}", "remax")
    # dp=2 beside ep=2: the distributed optimizer shards, and two PPO mini-batches gather rows over dp
    # no load-balancing loss: its gradient (Qwen3-Next's router_aux_loss_coef) would move the weights
    # between the two mini-batches, and the second's ratio would leave 1 (measured 1.0044; 1.0 without it)
    rows = train(tmp_path / "run", "trainer.train_steps=1", "model.moe_token_dispatcher=alltoall",
                 "algorithm.ppo_mini_batch_size=4", "model.moe_aux_loss_coeff=0.0", config=config)
    first_step_agrees(rows[0], FP32_LOGP)
    assert rows[0]["actor/optimizer_steps"] == 2
    assert "moe/routing_mismatch_frac" in rows[0]


def test_split_placement_transfer(tmp_path):
    rows = train(tmp_path / "run", "trainer.train_steps=2", "trainer.placement=split", "parallel.rollout.nproc=2")
    first_step_agrees(rows[0])
    assert rows[0]["sync/bytes_over_shard_max"] == 0


def test_train_lm_step(tmp_path):
    proc = megarl("train-lm", str(ROOT / "configs/lm_demo.yaml"), f"trainer.run_dir={tmp_path / 'lm'}",
                  "trainer.train_steps=2", cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DeviceMismatch" not in proc.stderr
