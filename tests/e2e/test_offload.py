"""Offload in the colocated RL loop (trainer.offload): PPO with a critic and a reference trains
bit-identically with every kind of state offloaded while the rollout generates (checkpoints
written while offloaded included), and both runs report the peak host memory of each phase."""

from __future__ import annotations

import json

import pytest

from megarl.config import load_config
from megarl.entrypoints.train_rl import prepare, run
from tests import ray_cluster

ARGS = ["algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.samples_per_prompt=2", "data.prompts_per_step=8",
        "trainer.train_steps=3", "trainer.save_interval=2", "logging.progress_bar=false", "logging.backends=[console]"]
ALL_ON = ["trainer.offload.params=true", "trainer.offload.grads=true", "trainer.offload.optimizer=true"]
PHASES = ("memory/host_peak_gb/generate", "memory/host_peak_gb/train")


def train(run_dir, *overrides):
    run(prepare(load_config(["configs/grpo_demo.yaml"], [f"trainer.run_dir={run_dir}", *ARGS, *overrides,
                                                                   *ray_cluster.overrides()])))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((run_dir / "final.json").read_text())["actor_weights_checksum"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train(tmp_path_factory.mktemp("resident")), train(tmp_path_factory.mktemp("offloaded"), *ALL_ON)


def test_offloaded_training_is_bit_exact(runs):
    (plain, plain_sum), (moved, moved_sum) = runs
    assert [r["step"] for r in moved] == [1, 2, 3]
    compared = [k for k in plain[0] if k.split("/")[0] in ("actor", "critic", "reward", "response", "rollout")]
    assert {"actor/loss", "actor/grad_norm", "critic/loss", "actor/kl", "reward/mean"} <= set(compared)
    for a, b in zip(plain, moved):
        assert {k: a[k] for k in compared} == {k: b[k] for k in compared}, a["step"]
    assert plain_sum == moved_sum


def test_memory_per_phase_and_offload_seconds(runs):
    (plain, _), (moved, _) = runs
    for r in plain + moved:
        assert all(0 < r[k] < 64 for k in PHASES), r
    assert all(r["time/offload_s"] > 0 and r["time/reload_s"] > 0 for r in moved)
    assert not any("time/offload_s" in r or "time/reload_s" in r for r in plain)

