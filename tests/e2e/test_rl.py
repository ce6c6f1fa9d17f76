"""RL end to end on CPU through Ray, colocated, actor t=2 → rollout t_g=1 (the hybrid engine
regroups every step): GRPO learns the built-in task; the first step's PPO ratio is 1 (rollout
and trainer log-probs agree); PPO with a critic, DAPO dynamic sampling, ReMax and the
one-step-off loop run; invalid configs fail before any worker starts, naming the field."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.models.hf_mapping import ConversionError
from megarl.data.datasets import DataError
from megarl.entrypoints.train_rl import prepare, run
from megarl.parallel import LayoutError
from tests import ray_cluster
from tests.cli import Started

DEMO = "configs/grpo_demo.yaml"
ROOT = Path(__file__).resolve().parents[2]


def history(tmp_path, *overrides):
    cfg = load_config([DEMO], [f"trainer.run_dir={tmp_path}", "logging.progress_bar=false", *overrides,
                               *ray_cluster.overrides()])
    return run(prepare(cfg))


def mean(rows, key="reward/mean"):
    return sum(r[key] for r in rows) / len(rows)


def started(tmp_path, *overrides) -> Started:
    """:func:`history`'s run as a new interpreter in the background, its run directory
    ``tmp_path / "run"``; :func:`finished` waits for it."""
    return Started("train", DEMO, f"trainer.run_dir={tmp_path / 'run'}", "logging.progress_bar=false", *overrides,
                   cwd=ROOT, out=tmp_path)


def finished(run: Started):
    """The run's directory and metrics rows, once it has ended."""
    done = run.wait()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    run_dir = run.out.parent / "run"
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def split_started(tmp_path_factory):
    """The 60-step split-placement run that test_split_placement_trains_the_same_curve compares
    with ``grpo``: started first, it runs beside it."""
    run = started(tmp_path_factory.mktemp("split"), *SPLIT, "trainer.train_steps=60")
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture(scope="module")
def on_policy_async_started(tmp_path_factory):
    """trainer.loop=async at max_staleness=0 (split placement), 60 steps: started before ``grpo``,
    beside it, for test_async_at_staleness_0_is_the_synchronous_loop."""
    run = started(tmp_path_factory.mktemp("async0"), *SPLIT, "trainer.loop=async", "trainer.max_staleness=0",
                  "trainer.train_steps=60")
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture(scope="module")
def grpo(tmp_path_factory, split_started, on_policy_async_started):
    path = tmp_path_factory.mktemp("grpo")
    return path, history(path, "trainer.train_steps=60")


def test_grpo_first_step_ratio_is_one(grpo):
    first = grpo[1][0]
    assert first["rollout/logp_max_abs_diff"] <= 1e-5  # rollout log-probs == trainer log-probs
    assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["actor/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert first["actor/clip_frac"] == 0.0
    assert 0 <= first["rollout_correction/kl"] <= 1e-9  # logged without a correction too


def test_grpo_reward_rises(grpo):
    rows = grpo[1]
    # seed 1: about 0.06 over the first ten steps and 0.13 over steps 51-60 (measured)
    assert mean(rows[-10:]) > mean(rows[:10]) + 0.03


def test_grpo_run_artifacts(grpo):
    path, rows = grpo
    assert (path / "reward_curve.png").stat().st_size > 1000
    assert (path / "mlflow.db").is_file()
    assert len((path / "metrics.jsonl").read_text().splitlines()) == 60
    assert all(r["batch/rows"] == 128 and r["time/weight_sync_s"] > 0 and r["time/generate_s"] > 0
               and r["time/reward_s"] > 0 for r in rows)
    # observability: entropy at entropy_coef 0, memory peaks over ranks, model FLOP/s (no MFU on CPU)
    assert all(r["actor/entropy"] > 0 and r["perf/model_tflops_per_s"] > 0 and "perf/mfu" not in r for r in rows)
    assert all(r["memory/worker_peak_rss_gb"] > 0 and r["memory/driver_peak_rss_gb"] > 0 for r in rows)


PPO = ("algorithm.name=ppo", "trainer.train_steps=4", "algorithm.samples_per_prompt=2", "algorithm.kl_coef=0.01",
       "algorithm.kl_in_reward=true", "algorithm.agg_mode=seq-mean-token-mean")


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    return history(tmp_path_factory.mktemp("ppo"), *PPO)


def test_ppo_with_critic(ppo):
    rows = ppo
    assert rows[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert rows[0]["rollout/logp_max_abs_diff"] <= 1e-5
    assert all("critic/loss" in r and r["critic/grad_norm"] > 0 for r in rows)


def test_packed_sequences_train_as_padded_ones(tmp_path, ppo):
    """data.pack_sequences=true: every role's passes (actor, critic, reference) run on packed
    micro-batches and the losses still aggregate per sequence (seq-mean-token-mean here): the first
    step's losses and gradient norms equal the padded run's to fp32 rounding, and the rollout's
    log-probs equal the packed trainer's."""
    rows = history(tmp_path, *PPO, "data.pack_sequences=true", "trainer.train_steps=1")
    first, padded = rows[0], ppo[0]
    assert first["reward/mean"] == padded["reward/mean"]  # the same samples: nothing trained yet
    assert first["rollout/logp_max_abs_diff"] <= 1e-5
    for key in ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm", "actor/entropy"):
        assert first[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key


def test_gspo_trains_with_mini_batches(tmp_path, grpo):
    """Also a bf16 rollout of the fp32 actor with token-level truncated importance sampling."""
    rows = history(tmp_path, "algorithm.policy_loss=gspo", "algorithm.clip_low=0.003", "algorithm.clip_high=0.004",
                   "algorithm.ppo_mini_batch_size=64", "trainer.train_steps=3",
                   "parallel.rollout.dtype=bfloat16", "algorithm.rollout_correction=token_tis")
    assert all(r["actor/optimizer_steps"] == 2 for r in rows)
    assert all(math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0 for r in rows)
    assert any(r["actor/clip_frac"] > 0 for r in rows)  # the second mini-batch's sequence ratios move
    keys = ["rollout_correction/" + k for k in ("kl", "weight_mean", "weight_max", "ratio_max", "frac_truncated")]
    assert all(math.isfinite(r[k]) for r in rows for k in keys)
    assert all(r["rollout_correction/weight_max"] <= 2.0 and r["rollout_correction/weight_mean"] > 0 for r in rows)
    # the bf16 rollout's mismatch to the fp32 trainer is far above the fp32 rollout's (grpo's first step)
    fp32 = grpo[1][0]
    assert rows[0]["rollout/logp_max_abs_diff"] > 10 * fp32["rollout/logp_max_abs_diff"]
    assert rows[0]["rollout_correction/kl"] > 10 * fp32["rollout_correction/kl"]


def test_dapo_dynamic_sampling_refills(tmp_path):
    """Also IcePop's double-sided masking of a bf16 rollout's tokens (algorithm.rollout_correction=icepop)."""
    rows = history(tmp_path, "algorithm.name=dapo", "algorithm.dynamic_sampling=true", "algorithm.clip_high=0.28",
                   "algorithm.overlong_buffer=2", "data.num_digits=2", "algorithm.max_new_tokens=4",
                   "algorithm.samples_per_prompt=4", "trainer.train_steps=3", "parallel.rollout.dtype=bfloat16",
                   "algorithm.rollout_correction=icepop")
    assert all(r["batch/rows"] == 16 * 4 for r in rows)  # the configured size, every step
    assert sum(r["sampling/dropped_groups"] for r in rows) > 0
    assert max(r["sampling/rounds"] for r in rows) > 1
    assert all(0 <= r["rollout_correction/frac_masked"] < 1 and 0 < r["rollout_correction/weight_max"] <= 2.0
               for r in rows)


def test_remax_greedy_baseline_with_kl_in_reward(tmp_path):
    """With the adaptive KL coefficient (algorithm.kl_target): step 1's KL is 0 (the policy is the
    reference), so step 2 applies beta x (1 - 0.2 x rows / horizon)."""
    rows = history(tmp_path, "algorithm.name=remax", "trainer.train_steps=2", "algorithm.samples_per_prompt=2",
                   "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "algorithm.kl_target=0.01",
                   "algorithm.kl_horizon=64", "algorithm.entropy_coef=0.01",
                   "optimizer.lr_warmup_steps=0")  # the policy moves at step 1
    assert rows[0]["reward/kl_coef"] == 0.05 and rows[0]["reward/kl_mean"] == 0.0
    assert rows[1]["reward/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * rows[0]["batch/rows"] / 64), rel=1e-12)
    assert rows[1]["reward/kl_mean"] > 0
    assert all("reward/baseline_mean" in r for r in rows)
    # the KL is in the scores the outcome estimator reads, and not also a loss term
    assert all(math.isfinite(r["reward/kl_penalty_mean"]) and "actor/kl" not in r for r in rows)
    assert rows[0]["reward/kl_penalty_mean"] == 0.0  # the first step's policy is the reference
    assert rows[1]["reward/kl_penalty_mean"] != 0.0


# VAPO on the demo: its 5-token responses get the length-adaptive lambda 1 - 1/(2 x 5) = 0.9, what VAPO's
# alpha of 0.05 gives a 200-token response (0.05 would clamp the demo's to 0: one-step TD on a young critic)
VAPO = ("algorithm.name=vapo", "algorithm.lam_length_alpha=2.0", "trainer.critic_warmup_steps=5")


def resumed_run(tmp_path, *overrides, stop=3, steps=60):
    """``megarl train`` on the demo for ``stop`` steps (saving at ``stop``), then again for
    ``steps``: the second run resumes after step ``stop``. The metrics of all the steps."""
    from tests.cli import megarl_here

    base = ["train", DEMO, f"trainer.run_dir={tmp_path}", "logging.progress_bar=false", "logging.backends=[console]",
            f"trainer.save_interval={stop}", *overrides, *ray_cluster.overrides()]
    first = megarl_here(*base, f"trainer.train_steps={stop}", cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    second = megarl_here(*base, f"trainer.train_steps={steps}", cwd=ROOT)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming after step {stop}" in second.stdout, second.stdout[-2000:]
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_vapo_resumes_in_its_warmup_and_reaches_grpos_reward(tmp_path, grpo):
    """megarl train algorithm.name=vapo at tp2 (critic, decoupled and length-adaptive GAE, positive LM
    loss), stopped in its value warm-up and resumed: steps 1-5 train the critic alone, the actor
    from step 6; over the last 10 of 60 steps its mean reward is within 0.05 of GRPO's (measured:
    vapo 0.120, the same as the run without the stop; grpo 0.152)."""
    rows = resumed_run(tmp_path, *VAPO)
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert ["actor/loss" in r for r in rows[:7]] == [False] * 5 + [True] * 2
    assert all(r["critic/grad_norm"] > 0 for r in rows)
    assert all(r["actor/positive_nll"] > 0 for r in rows[5:])
    assert abs(mean(rows[-10:]) - mean(grpo[1][-10:])) <= 0.05, (mean(rows[-10:]), mean(grpo[1][-10:]))
    print(f"vapo/grpo reward over steps 51-60: {mean(rows[-10:]):.4f} / {mean(grpo[1][-10:]):.4f}")


def test_prime_trains_its_implicit_prm_and_resumes(tmp_path):
    """megarl train algorithm.name=prime at tp2: the implicit PRM (the policy's starting weights,
    its reference the policy's) is updated each step before the advantages, and resumes from the
    run's checkpoint. Step 1's PRM equals its reference: every sequence logit is 0, its loss ln 2.
    (Its reward on the demo over 60 steps: docs/training.md.)"""
    rows = resumed_run(tmp_path, "algorithm.name=prime", stop=2, steps=3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["prm/score_mean"] == pytest.approx(0.5, abs=1e-6)
    assert all(r["prm/grad_norm"] > 0 and r["prm/optimizer_steps"] == 1 and 0 <= r["prm/pair_acc"] <= 1 for r in rows)
    assert rows[2]["prm/loss"] != rows[1]["prm/loss"]
    # the preset's accuracy filter (verl-recipe's): 4x the prompts drawn, those in [0.2, 0.8] first
    assert all(0 <= r["sampling/accuracy_kept_frac"] <= 1 and r["sampling/dropped_groups"] > 0 for r in rows)


def learning(row):
    """A step's metrics but its timings and sizes (what a run's numbers, not its speed, are)."""
    return {k: v for k, v in row.items()
            if not k.startswith(("time/", "throughput/", "perf/", "memory/")) and not k.endswith(("seconds", "_s"))}


def held_out_split(path, count=24, seed=1234):
    """The demo task's prompts from another seed, as a dataset file (data.val_files)."""
    from megarl.tasks.reverse_digits import reverse_digits_records

    path.write_text("".join(json.dumps({"prompt": r.prompt, "answer": r.answer}) + "\n"
                            for r in reverse_digits_records(count, 4, seed)))
    return path


def test_validation_changes_no_training_metric(tmp_path, grpo, monkeypatch):
    """``megarl train`` on the demo with a held-out split as data.val_files, trainer.val_interval=10,
    n=4 samples at temperature 1: validations at steps 0, 10 and 20; every training metric of its
    20 steps equals the run without validation's (the grpo fixture's first 20: a constant LR after
    warmup); pass@k and maj@n equal brute force over the dumped responses. Every tracker
    (MLflow, TensorBoard, wandb offline, SwanLab offline) holds every metric of every step and
    validation, under the same name. ``megarl eval`` on the run's final HF export reproduces the
    last validation's metrics (the same seed, weights and draws)."""
    import itertools

    from tests.cli import megarl_here
    from tests.trackers import READERS, wandb_exit_code

    val = held_out_split(tmp_path / "val.jsonl")
    settings = (f"data.val_files=[{val}]", "algorithm.val_samples_per_prompt=4", "algorithm.val_temperature=1.0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    run_dir = tmp_path / "run"
    proc = megarl_here("train", str(ROOT / DEMO), f"trainer.run_dir={run_dir}", "logging.progress_bar=false",
                       "trainer.train_steps=20", "trainer.val_interval=10", "trainer.save_interval=20",
                       "trainer.log_interval=10", "logging.backends=[console,mlflow,tensorboard,wandb,swanlab]",
                       *settings, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [learning(r) for r in rows] == [learning(r) for r in grpo[1][:20]]
    vals = [json.loads(line) for line in (run_dir / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, 10, 20]
    # the console: a metrics line every trainer.log_interval steps, and each validation's
    assert [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith(("step ", "validation "))] == [
        "validation at step 0", "step 10", "validation at step 10", "step 20", "validation at step 20"]
    expected = {}  # {name: {step: value}} of metrics.jsonl and validation.jsonl
    for r in rows + vals:
        for key, value in r.items():
            if key != "step":
                expected.setdefault(key.replace("@", "_at_"), {})[r["step"]] = value
    for backend, read in READERS.items():
        tracked = read(run_dir)
        assert set(tracked) >= set(expected), (backend, sorted(set(expected) - set(tracked)))
        for name, series in expected.items():
            close = 1e-6 if backend == "tensorboard" else 0  # TensorBoard keeps float32
            assert tracked[name] == pytest.approx(series, rel=close, abs=close), (backend, name)
    assert wandb_exit_code(run_dir) == 0
    for v in vals:
        dumped = [json.loads(line) for line in
                  (run_dir / "validation" / f"step_{v['step']}.jsonl").read_text().splitlines()]
        assert len(dumped) == 24 * 4 and v["val/prompts"] == 24
        groups = [[d for d in dumped if d["prompt_index"] == p] for p in range(24)]
        for k in (1, 4):
            brute = sum(sum(any(d["reward"] >= 1 for d in subset) for subset in itertools.combinations(g, k))
                        / math.comb(4, k) for g in groups) / 24
            assert v[f"val/pass@{k}"] == pytest.approx(brute, abs=1e-12), (v["step"], k)
        majority = []
        for g in groups:
            answers = [d["response"].strip() for d in g]
            top = max(answers.count(a) for a in answers)
            winner = next(a for a in answers if answers.count(a) == top)
            majority.append(next(d["reward"] for d in g if d["response"].strip() == winner))
        assert v["val/maj@4"] == pytest.approx(sum(majority) / 24, abs=1e-12)
        assert v["val/reward/mean@4"] == pytest.approx(sum(d["reward"] for d in dumped) / len(dumped), abs=1e-12)
    assert vals[-1]["val/reward/mean@4"] > vals[0]["val/reward/mean@4"] + 0.03  # it learned, held out (measured 0.044 -> 0.117)
    assert megarl_here("export-hf", str(run_dir), str(tmp_path / "hf"), cwd=tmp_path).returncode == 0
    proc = megarl_here("eval", str(ROOT / DEMO), f"model.path={tmp_path / 'hf'}", "model.hf_config=null", *settings,
                       f"trainer.run_dir={tmp_path / 'eval'}", "logging.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert summary["metrics"] == {k: v for k, v in vals[-1].items() if k != "step"}
    assert len((tmp_path / "eval" / "eval_responses.jsonl").read_text().splitlines()) == 24 * 4


SPLIT = ("trainer.placement=split", "parallel.rollout.nproc=2")  # 2 training ranks + 2 rollout ranks


def final_checksum(path):
    return json.loads((path / "final.json").read_text())["actor_weights_checksum"]


def test_split_placement_trains_the_same_curve(split_started, grpo):
    """4 ranks (actor t=2 on two, rollout t_g=1 d_g=2 on two others), synchronous: the samples,
    rewards and weights of the colocated run, step for step (the sync moves fp32 exactly), and
    each rollout rank receives exactly its generation shard. (A new interpreter, run beside
    ``grpo``'s.)"""
    run_dir, rows = finished(split_started)
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in grpo[1]]
    assert [r["actor/loss"] for r in rows] == pytest.approx([r["actor/loss"] for r in grpo[1]], rel=1e-6, abs=1e-9)
    assert final_checksum(run_dir) == final_checksum(grpo[0])
    assert rows[0]["rollout/logp_max_abs_diff"] <= 1e-5
    # tiny-digits at fp32: each rollout rank's shard is the whole model (t_g=1)
    assert all(r["sync/bytes_over_shard_max"] == 0 and r["sync/bytes_received"] == 98624 * 4 for r in rows)
    # each TP rank sends its half of the split tensors to both rollout ranks; the 320 elements both
    # hold (norms) go from TP rank 0 to both, packed once (transfer.plan_transfer): rank 0 sends
    # 98304 + 2 * 320 = 98944 elements, rank 1 98304 (together twice the 98624-element shard)
    assert all(r["sync/bytes_sent_max"] == 98944 * 4 for r in rows)


# Sample-level streaming, 50 steps: partial rollouts of 2 tokens per chunk, 16 rows in flight (one
# step's), staleness bound 2, policy wait (groups trained in admission order); a checkpoint at 47.
ASYNC = (*SPLIT, "trainer.loop=async", "trainer.max_staleness=2", "algorithm.rollout_correction=token_tis",
         "trainer.train_steps=50", "parallel.rollout.partial_rollout=true", "parallel.rollout.partial_chunk_tokens=2",
         "logging.rollout_dump_interval=1", "algorithm.max_new_tokens=24", "data.prompts_per_step=4",
         "algorithm.samples_per_prompt=4", "trainer.save_interval=47")


@pytest.fixture(scope="module")
def async_started(tmp_path_factory):
    """The 50-step sample-streaming run: started by test_one_step_off_staleness, beside its runs."""
    run = started(tmp_path_factory.mktemp("async"), *ASYNC)
    try:
        yield run
    finally:
        run.stop()  # after a failure before it was waited for


def dumped_rows(run_dir, step):
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_async_at_staleness_0_is_the_synchronous_loop(on_policy_async_started, grpo):
    """Sample-level streaming on policy (max_staleness=0, no partial rollouts): each step's groups
    are admitted once the weights they train against are synced, with the synchronous loop's seeds,
    so the run is the synchronous one: the same rewards, losses and final weights at all 60 steps."""
    run_dir, rows = finished(on_policy_async_started)
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in grpo[1]]
    assert [r["actor/loss"] for r in rows] == pytest.approx([r["actor/loss"] for r in grpo[1]], rel=1e-6, abs=1e-9)
    assert all(r["sampling/staleness"] == 0 and r["sampling/token_lag_0"] == 1.0 for r in rows)
    assert final_checksum(run_dir) == final_checksum(grpo[0])


def test_one_step_off_staleness(tmp_path, async_started):
    """Colocated (in line) and split (drawn in a driver thread while the actor trains): the same
    schedule of policy versions, so the same batches and rewards; streaming (max_staleness=2)
    with partial rollouts keeps every token within its bound, and resumes with batches in flight."""
    # Streaming with partial rollouts, 16 rows of up to 24 tokens: a weight sync that comes while
    # a batch is generated goes in between two of its tokens. Started first, beside the other two.
    steps = 6
    streaming = (*SPLIT, "trainer.loop=one_step_off", "trainer.max_staleness=2", "algorithm.rollout_correction=token_tis",
                 f"trainer.train_steps={steps}", "parallel.rollout.partial_rollout=true",
                 "parallel.rollout.partial_chunk_tokens=1", "logging.rollout_dump_interval=1",
                 "algorithm.max_new_tokens=24", "data.prompts_per_step=4", "algorithm.samples_per_prompt=4",
                 "trainer.save_interval=3")
    streamed = started(tmp_path / "stream", *streaming)
    try:
        rows = history(tmp_path / "colocated", "trainer.loop=one_step_off", "trainer.train_steps=4")
        split = history(tmp_path / "split", *SPLIT, "trainer.loop=one_step_off", "trainer.train_steps=4")
        run_dir, stream = finished(streamed)
    finally:
        streamed.stop()  # after a failure above
    assert [r["sampling/staleness"] for r in rows] == [0, 1, 1, 1]
    assert [r["policy_version"] for r in rows] == [0, 0, 1, 2]
    assert rows[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert [r["policy_version"] for r in split] == [0, 0, 1, 2]
    assert [r["reward/mean"] for r in split] == [r["reward/mean"] for r in rows]
    assert final_checksum(tmp_path / "split") == final_checksum(tmp_path / "colocated")
    assert all(r["time/generate_s"] > 0 and r["time/wait_rollout_s"] >= 0 for r in split)
    # Every token's version, as dumped, is within the bound of the actor that trains on it.
    # (Whether a sync lands mid-batch depends on timing here; the interruption itself is forced
    # in tests/distributed/test_rollout.py.)
    staleness = [r["sampling/staleness"] for r in stream]
    assert staleness[0] == 0 and all(0 <= s <= 2 for s in staleness) and max(staleness) >= 1
    assert all(r["sampling/staleness_mean"] <= r["sampling/staleness"] for r in stream)
    assert all(r["sampling/token_staleness_mean"] <= r["sampling/staleness_mean"] for r in stream)
    assert all(sum(r[f"sampling/token_lag_{k}"] for k in range(3)) == pytest.approx(1.0) for r in stream)
    for step, metrics in enumerate(stream, 1):
        dumped = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        mixed = 0
        for row in dumped:
            versions = row.get("token_versions", [row["policy_version"]] * len(row["response_ids"]))
            assert len(versions) == len(row["response_ids"]) and versions[0] == row["policy_version"]
            assert versions == sorted(versions) and all(0 <= (step - 1) - v <= 2 for v in versions), (step, row)
            mixed += len(set(versions)) > 1
        assert metrics["sampling/mixed_rows"] == pytest.approx(mixed / len(dumped))
    print("mixed rows per step:", [r["sampling/mixed_rows"] for r in stream])

    # Resumed from step 3's checkpoint, taken while batches 4 and 5 were drawn ahead (in flight):
    # steps 4-6 train on the same prompts as the uninterrupted run, none lost or twice.
    def prompts(step):
        dump = run_dir / "rollouts" / f"step_{step}.jsonl"
        return sorted(tuple(json.loads(line)["prompt_ids"]) for line in dump.read_text().splitlines())

    uninterrupted = [prompts(step) for step in range(4, steps + 1)]
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{steps:06d}")
    (checkpoints / "latest").write_text("step_000003")
    resumed = history(run_dir, *streaming)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    assert [prompts(step) for step in range(4, steps + 1)] == uninterrupted


def test_sample_streaming_keeps_every_token_within_its_bound_for_50_steps(async_started):
    """trainer.loop=async: every token of every step's batch (as dumped) was sampled at most 2
    versions before the actor that trains on it, groups are whole, nothing is dropped under
    staleness_policy=wait, and the run resumed from step 47 (groups in flight then) trains the same
    prompts at steps 48-50 as the uninterrupted run: none lost, none twice."""
    run_dir, rows = finished(async_started)
    assert [r["step"] for r in rows] == list(range(1, 51))
    assert all(r["sampling/stale_dropped_groups"] == 0 and r["sampling/staleness"] <= 2 for r in rows)
    assert max(r["sampling/staleness"] for r in rows) == 2 and any(r["sampling/mixed_rows"] > 0 for r in rows)
    assert all(0 <= r["sampling/rollout_idle_frac"] <= 1 and r["sampling/in_flight_rows"] <= 16 for r in rows)
    tokens, seen = 0, []
    for step in range(1, 51):
        batch = dumped_rows(run_dir, step)
        assert len(batch) == 16
        for row in batch:
            versions = row.get("token_versions", [row["policy_version"]] * len(row["response_ids"]))
            assert len(versions) == len(row["response_ids"]) and versions == sorted(versions)
            assert all(0 <= (step - 1) - v <= 2 for v in versions), (step, row)
            tokens += len(versions)
        groups = [tuple(r["prompt_ids"]) for r in batch]
        assert all(groups.count(g) % 4 == 0 for g in groups)  # whole groups of 4 samples
        seen.append(sorted(groups))
    assert tokens > 50 * 16 * 2
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / "step_000050")
    (checkpoints / "latest").write_text("step_000047")
    resumed = history(run_dir, *ASYNC)
    assert [r["step"] for r in resumed] == list(range(1, 51))
    assert [sorted(tuple(r["prompt_ids"]) for r in dumped_rows(run_dir, s)) for s in (48, 49, 50)] == seen[47:]


JUDGE_AT_CONFIGS = ("reward_model.path=configs", "reward_model.hf_config=configs/models/tiny-digits.json")  # no weights


@pytest.mark.parametrize("overrides,error,field", [
    (["parallel.actor.tp=1", "data.prompts_per_step=3", "algorithm.samples_per_prompt=3"], ConfigError,
     "data.prompts_per_step"),
    (["parallel.rollout.tp=3"], ConfigError, "parallel.rollout"),
    (["parallel.actor.tp=3"], LayoutError, "world size 2 is not divisible by tp"),
    (["data.train_files=[tests/e2e/data/prompts.jsonl]", "data.prompt_key=question"], DataError, "data.prompt_key"),
    (["algorithm.name=sac"], ConfigError, "algorithm.name"),
    (["trainer.checkpoint_format=zip"], ConfigError, "trainer.checkpoint_format"),
    (["algorithm.temperature=0"], ConfigError, "algorithm.temperature=0 must be a positive number"),
    (["algorithm.temperature=-1"], ConfigError, "algorithm.temperature"),
    (["trainer.max_bad_steps=0"], ConfigError, "trainer.max_bad_steps"),
    (["algorithm.ppo_mini_batch_size=48"], ConfigError, "algorithm.ppo_mini_batch_size=48 must divide the 128"),
    (["parallel.actor.tp=1", "algorithm.ppo_mini_batch_size=1"], ConfigError, "multiple of the actor's dp=2"),
    (["algorithm.ppo_epochs=0"], ConfigError, "algorithm.ppo_epochs"),
    (["trainer.critic_warmup_steps=5"], ConfigError, "trainer.critic_warmup_steps=5 warms up a critic; "
                                                      "algorithm.name=grpo has none"),
    (["algorithm.lam_critic=1.0"], ConfigError, "algorithm.lam_critic=1.0 is the GAE lambda of the critic's"),
    (["algorithm.name=prime", "algorithm.reward_fn=model"], ConfigError, "algorithm.name=prime with "
                                                                         "algorithm.reward_fn=model"),
    (["algorithm.name=prime", "reward_model.path=configs"], ConversionError, "reward_model.path=/"),
    # a generative reward model (LLM judge)
    (["reward_model.generative=true", "algorithm.reward_fn=model"], ConfigError,
     "reward_model.generative needs reward_model.path"),
    (["reward_model.generative=true", *JUDGE_AT_CONFIGS], ConfigError, "no row would be judged"),
    (["reward_model.generative=true", *JUDGE_AT_CONFIGS, "algorithm.reward_fn=model",
      "reward_model.template=grade {answer}"], ConfigError, r"reward_model.template has the field\(s\) \['answer'\]"),
    (["reward_model.generative=true", *JUDGE_AT_CONFIGS, "algorithm.reward_fn=model",
      "reward_model.parser=no_such_module:fn"], ConfigError, "reward_model.parser='no_such_module:fn': cannot import"),
    (["reward_model.generative=true", *JUDGE_AT_CONFIGS, "algorithm.reward_fn=model",
      "trainer.loop=one_step_off"], ConfigError, "the judge runs on the training ranks"),
    (["reward_model.generative=true", *JUDGE_AT_CONFIGS, "algorithm.reward_fn=model"], ConversionError,
     "reward_model.path=/"),
    (["algorithm.reward_fn_by_source={a: model}"], ValueError, "only a generative reward model"),
    (["algorithm.policy_loss=trpo"], ConfigError, "algorithm.policy_loss='trpo' must be one of"),
    (["algorithm.rollout_correction=tis"], ConfigError, "algorithm.rollout_correction='tis' must be one of"),
    (["algorithm.rollout_correction_threshold=0.5"], ConfigError, "algorithm.rollout_correction_threshold=0.5"),
    (["parallel.rollout.dtype=fp8"], ConfigError, "parallel.rollout.dtype='fp8' must be one of"),
    (["parallel.rollout.engine=tensorrt"], ConfigError, "parallel.rollout.engine='tensorrt' must be one of"),
    (["parallel.rollout.engine=sglang", "parallel.rollout.dtype=bfloat16"], ConfigError,
     "SGLang generates in the actor's dtype"),
    (["algorithm.reward_fn=nope"], ValueError, "algorithm.reward_fn: unknown reward function 'nope'"),
    (["algorithm.reward_fn=no_such_module:fn"], ValueError, "algorithm.reward_fn='no_such_module:fn': cannot import"),
    # sizes and rates out of the bounds declared in the schema: named by load_config
    (["optimizer.lr=-0.01"], ConfigError, "optimizer.lr=-0.01 must be >= 0"),
    (["data.prompts_per_step=0"], ConfigError, "data.prompts_per_step=0 must be >= 1"),
    (["trainer.nproc_per_node=0"], ConfigError, "trainer.nproc_per_node=0 must be >= 1"),
    (["trainer.keep_checkpoints=0"], ConfigError, "trainer.keep_checkpoints=0 must be >= 1"),
    (["optimizer.adam_beta2=1.0", "algorithm.top_p=0"], ConfigError,
     "optimizer.adam_beta2=1.0 must be >= 0 and < 1; algorithm.top_p=0.0 must be > 0 and <= 1"),
    (["optimizer.clip_grad=nan"], ConfigError, "optimizer.clip_grad=nan must be >= 0"),
    # weight sync
    (["parallel.rollout.weight_sync=xor"], ConfigError, "parallel.rollout.weight_sync='xor' must be one of"),
    (["parallel.rollout.engine=sglang", "parallel.rollout.weight_sync=delta"], ConfigError,
     "parallel.rollout.weight_sync=delta: engine=sglang takes whole tensors"),
    # placement and the asynchronous loop
    (["trainer.placement=apart"], ConfigError, "trainer.placement='apart' must be one of"),
    (["trainer.placement=split"], ConfigError, "parallel.rollout.nproc >= 1"),
    (["trainer.placement=split", "parallel.rollout.nproc=3", "parallel.rollout.tp=2"], ConfigError,
     "parallel.rollout.nproc=3 must be a multiple of parallel.rollout.tp=2"),
    (["trainer.placement=split", "parallel.rollout.nproc=2", "trainer.offload.optimizer=true"], ConfigError,
     "trainer.offload is for colocated placement"),
    (["trainer.loop=one_step_off", "trainer.max_staleness=1"], ConfigError, "set trainer.placement=split"),
    (["trainer.placement=split", "parallel.rollout.nproc=2", "trainer.max_staleness=1"], ConfigError,
     "trainer.max_staleness=1 needs trainer.loop=one_step_off or async"),
    (["trainer.placement=split", "parallel.rollout.nproc=2", "trainer.loop=one_step_off", "trainer.max_staleness=2"],
     ConfigError, "set algorithm.rollout_correction"),
    (["parallel.rollout.recompute_kv_after_sync=true"], ConfigError, "applies to partial rollouts"),
    (["parallel.rollout.partial_rollout=true"], ConfigError,
     "set trainer.placement=split and trainer.loop=one_step_off or async \\(got colocated, sync\\)"),
    ([*SPLIT, "trainer.loop=one_step_off", "parallel.rollout.partial_rollout=true", "parallel.rollout.engine=sglang",
      "parallel.rollout.dtype=float32"], ConfigError, "engine=sglang does not pause for a weight sync here yet"),
    ([*SPLIT, "trainer.loop=one_step_off", "parallel.rollout.partial_rollout=true", "parallel.rollout.engine=vllm",
      "data.val_files=[tests/e2e/data/prompts.jsonl]"], ConfigError,
     "engine=vllm with partial_rollout=true and data.val_files"),
    # sample-level streaming
    (["trainer.loop=async"], ConfigError, "trainer.loop=async streams samples from the rollout's own ranks"),
    ([*SPLIT, "trainer.loop=async", "parallel.rollout.engine=sglang", "parallel.rollout.dtype=float32"], ConfigError,
     "engine=sglang does not take requests into a rollout in flight"),
    ([*SPLIT, "trainer.loop=async", "parallel.rollout.engine=vllm", "data.val_files=[tests/e2e/data/prompts.jsonl]"],
     ConfigError, "engine=vllm with trainer.loop=async and data.val_files"),
    ([*SPLIT, "trainer.loop=async", "algorithm.name=remax"], ConfigError, "its greedy baseline is drawn per batch"),
    ([*SPLIT, "trainer.loop=async", "parallel.rollout.max_inflight=4"], ConfigError,
     "parallel.rollout.max_inflight=4 cannot hold one group of algorithm.samples_per_prompt=8"),
    (["trainer.staleness_policy=drop"], ConfigError, "trainer.staleness_policy=drop applies to sample-level streaming"),
    (["parallel.rollout.max_inflight=64"], ConfigError, "parallel.rollout.max_inflight=64 applies to trainer.loop=async"),
    (["trainer.staleness_policy=late"], ConfigError, "trainer.staleness_policy='late' must be one of"),
])
def test_invalid_configs_fail_before_workers(overrides, error, field):
    start = time.perf_counter()
    with pytest.raises(error, match=field.replace(".", r"\.").replace("*", r"\*")):
        prepare(load_config([DEMO], overrides))
    assert time.perf_counter() - start < 5


def test_layouts_of_trained_roles_are_the_actors(capsys):
    with pytest.raises(ConfigError, match=r"parallel\.critic differs from parallel\.actor"):
        prepare(load_config([DEMO], ["parallel.critic.tp=1", "parallel.critic.dp=2"]))
    prepare(load_config([DEMO], ["parallel.critic.tp=2"]))  # the actor's: fine


def test_cli_reports_the_field_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", DEMO, "parallel.actor.tp=1", "data.prompts_per_step=3",
                           "algorithm.samples_per_prompt=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "data.prompts_per_step" in proc.stderr and "ray" not in proc.stderr.lower()


def test_temperature_zero_exits_2_saying_greedy_is_explicit(capsys):
    from megarl.cli import main

    assert main(["train", DEMO, "algorithm.temperature=0", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.temperature=0" in err and "Greedy" in err


def test_reward_model_role(tmp_path):
    from tests.distributed.launch import torchrun

    torchrun(1, "tests/distributed/reward_model_worker.py", "reference", str(tmp_path))
    rows = history(tmp_path / "run", "algorithm.reward_fn=model", f"reward_model.checkpoint={tmp_path / 'rm'}",
                   "reward_model.hf_config=configs/models/tiny-llama.json", "trainer.train_steps=2")
    assert len(rows) == 2 and rows[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert rows[0]["reward/max"] != rows[0]["reward/min"]  # real scores from the scalar head
    with pytest.raises(ConfigError, match="reward_model.checkpoint"):
        prepare(load_config([DEMO], ["algorithm.reward_fn=model"]))


def test_report_draws_the_run(grpo):
    path, _ = grpo
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "report", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = {line.rsplit("/", 1)[-1] for line in proc.stdout.split()}
    assert {"reward.png", "response_length.png", "policy.png", "timing.png", "throughput.png", "memory.png"} <= names
    assert all((path / "report" / n).stat().st_size > 5000 for n in names)


@pytest.mark.parametrize("placement,expect", [
    ([], ["(sglang)", "update_weights_from_tensor", "resume SGLang's KV cache"]),
    (list(SPLIT), ["rollout 2 ranks", "update_weights_from_distributed", "broadcasts"]),
])
def test_sglang_runs_are_planned_on_cpu(capsys, placement, expect):
    """--dry-run prints an SGLang run's plan on a machine without GPUs; the run itself refuses
    there, before any process starts, naming what it needs."""
    from megarl.cli import main

    assert main(["train", DEMO, "parallel.rollout.engine=sglang", *placement, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(e in out for e in expect), out
    if not torch_cuda():
        assert main(["train", DEMO, "parallel.rollout.engine=sglang", *placement]) == 2
        assert "parallel.rollout.engine=sglang needs CUDA" in capsys.readouterr().err


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_context_parallel_actor(tmp_path):
    """GRPO with the actor at cp=2 (each sequence split over two ranks, SDPA CP attention on CPU):
    the rollout (cp folded into its data parallelism) and the trainer agree on every log-prob,
    so the first PPO ratio is 1."""
    rows = history(tmp_path, "parallel.actor.tp=1", "parallel.actor.cp=2", "trainer.train_steps=2")
    assert rows[0]["rollout/logp_max_abs_diff"] <= 1e-5
    assert rows[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert all(math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("placement", [(), SPLIT], ids=["colocated", "split"])
def test_delta_weight_sync_trains_as_full(tmp_path, placement):
    """parallel.rollout.weight_sync=delta through megarl train, bf16 rollout of the fp32 actor: the
    rollout's weights equal a full sync's at every step, so the samples, rewards and the rollout's
    log-probs do too (a single differing bf16 bit would move them); after the first sync it
    receives a fraction of full's bytes, its peak extra memory and the sender's copy are logged."""
    common = (*placement, "parallel.rollout.dtype=bfloat16", "algorithm.rollout_correction=token_tis",
              "trainer.train_steps=4")
    full = history(tmp_path / "full", *common)
    delta = history(tmp_path / "delta", *common, "parallel.rollout.weight_sync=delta")
    for key in ("reward/mean", "rollout/logp_max_abs_diff", "rollout_correction/kl", "actor/loss"):
        assert [r[key] for r in delta] == [r[key] for r in full], key
    assert all(r["sync/bytes_fraction"] == 1.0 for r in full)
    # every sync logged is after the first; the warmup's first step has lr 0: nothing changes
    assert delta[0]["sync/bytes_fraction"] == 0 and all(0 < r["sync/bytes_fraction"] < 1.0 for r in delta[1:])
    assert all(0 < r["sync/peak_extra_mb"] <= 256 and r["sync/delta_copy_mb"] > 0 for r in delta)
    assert all(r["sync/delta_copy_mb"] == 0 for r in full)
