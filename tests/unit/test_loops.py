"""The synchronous and one-step-off loops against scripted roles (no model): the same training
half, the rollout's memory released for training and resumed for generation and weight sync in
both, the policy version each batch was drawn from, and the staleness logged."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megarl.protocol import Batch
from megarl.trainer import loop, one_step_off
from megarl.trainer.steps import Scorer
from tests.unit.test_trainer_steps import TOK, ScriptedRollout, algo, stream


class Roles:
    """Scripted roles that share one event log; the rollout refuses to generate or sync while its
    memory is released, and the training verbs refuse to run while it is held (the hybrid engine)."""

    def __init__(self, critic: bool):
        self.events, self.released = [], False
        self.rollout = SimpleNamespace(generate=self.generate, update_weights=self.update_weights,
                                       release_memory=lambda: self.memory(True),
                                       resume_memory=lambda: self.memory(False))
        self.actor = SimpleNamespace(compute_log_prob=lambda b: self.forward("old_log_probs", b),
                                     update=lambda b: self.update("actor", b))
        self.reference = None
        self.critic = SimpleNamespace(compute_values=lambda b: self.forward("values", b),
                                      update=lambda b: self.update("critic", b)) if critic else None
        self.scripted = ScriptedRollout()

    def memory(self, release: bool):
        assert self.released != release, "released twice or resumed twice"
        self.released = release
        self.events.append("release" if release else "resume")

    def generate(self, prompts, sampling):
        assert not self.released, "generate on released memory"
        self.events.append("generate")
        return self.scripted.generate(prompts, sampling)

    def update_weights(self, version):
        assert not self.released, "weight sync on released memory"
        self.events.append(f"sync {version}")
        return {"sync/seconds": 0.0}

    def forward(self, column, batch):
        assert self.released, "training role ran while the rollout held the memory"
        self.events.append(column)
        return Batch({column: torch.zeros_like(batch["loss_mask"])})

    def update(self, role, batch):
        assert self.released
        self.events.append(f"{role} update v{batch.policy_version}")
        return {f"{role}/loss": 1.0}


class Log:
    def __init__(self):
        self.rows = []

    def phase(self, name):
        return contextlib.nullcontext()

    def step(self, step, batch, metrics):
        self.rows.append({"step": step, "policy_version": batch.policy_version, **metrics})


def run(train, name, steps=3):
    a = algo(name=name)
    cfg = SimpleNamespace(algorithm=a, data=SimpleNamespace(prompts_per_step=2),
                          trainer=SimpleNamespace(seed=0, train_steps=steps))
    roles, log = Roles(critic=name == "ppo"), Log()
    scorer = Scorer(a, TOK)
    try:
        train(cfg, roles, stream(), scorer, log, eos_token_ids=[TOK.eos_token_id], pad_token_id=TOK.pad_token_id)
    finally:
        scorer.close()
    return roles.events, log.rows


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_both_loops_run_the_same_training_half(name):
    half = (["old_log_probs", "values", "critic update", "actor update"] if name == "ppo"
            else ["old_log_probs", "actor update"])
    events, rows = run(loop.train, name)
    step = lambda v: ["generate", "release", *[e if "update" not in e else f"{e} v{v}" for e in half], "resume",
                      f"sync {v + 1}"]
    assert events == ["sync 0", *step(0), *step(1), *step(2)]
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    assert all(r["sampling/rounds"] == 1 and "actor/loss" in r for r in rows)

    events, rows = run(one_step_off.train, name)
    off = lambda v, draw: [*(["generate"] if draw else []), "release",
                           *[e if "update" not in e else f"{e} v{max(v - 1, 0)}" for e in half], "resume", f"sync {v + 1}"]
    # step k+1's batch is drawn before update k, from the same weights as step k's
    assert events == ["sync 0", "generate", *off(0, True), *off(1, True), *off(2, False)]
    assert [r["policy_version"] for r in rows] == [0, 0, 1]
    assert [r["sampling/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["sampling/rounds"] == 1 and "actor/loss" in r for r in rows)
