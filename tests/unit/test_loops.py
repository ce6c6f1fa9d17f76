"""The synchronous and one-step-off loops against scripted roles (no model): the same training
half, the rollout's memory released for training and resumed for generation and weight sync in
both, the policy version each batch was drawn from, and the staleness logged."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megarl.protocol import Columns
from megarl.trainer import loop, one_step_off
from megarl.trainer.steps import Scorer
from tests.unit.test_trainer_steps import TOK, ScriptedRollout, algo, stream


class Roles:
    """Scripted roles that share one event log; the rollout refuses to generate or sync while its
    memory is released, and the training verbs refuse to run while it is held (the hybrid engine)."""

    def __init__(self, critic: bool, prm: bool = False):
        self.events, self.released = [], False
        self.rollout = SimpleNamespace(generate=self.generate, update_weights=self.update_weights,
                                       release_memory=lambda: self.memory(True),
                                       resume_memory=lambda: self.memory(False))
        self.actor = SimpleNamespace(compute_log_prob=lambda b: self.forward("old_log_probs", b),
                                     update=lambda b: self.update("actor", b))
        self.reference = None
        self.critic = SimpleNamespace(compute_values=lambda b: self.forward("values", b),
                                      update=lambda b: self.update("critic", b)) if critic else None
        self.prm = SimpleNamespace(compute_rewards=lambda b: self.forward("process_rewards", b),
                                   update=lambda b: self.labelled_update("prm", b)) if prm else None
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
        self.scripted.version = version
        return {"sync/seconds": 0.0}

    def forward(self, column, batch):
        assert self.released, "training role ran while the rollout held the memory"
        self.events.append(column)
        return Columns({column: torch.zeros_like(batch.loss_mask)})

    def labelled_update(self, role, batch):
        assert torch.equal(batch.prm_labels, batch.raw_scores.clamp(0, 1)[:, None] * batch.loss_mask)
        return self.update(role, batch)

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


def rollout_layout(chunk=None):
    """parallel.rollout as the loops read it: partial rollouts of ``chunk`` tokens, or none."""
    return SimpleNamespace(rollout=SimpleNamespace(partial_rollout=chunk is not None, partial_chunk_tokens=chunk or 8))


def run(train, name, steps=3, roles=None, agent=None, chunk=None, **trainer):
    a = algo(name=name)
    cfg = SimpleNamespace(algorithm=a, data=SimpleNamespace(prompts_per_step=2), parallel=rollout_layout(chunk),
                          trainer=SimpleNamespace(**{"seed": 0, "train_steps": steps, "placement": "colocated",
                                                     "max_staleness": 0, "critic_warmup_steps": 0,
                                                     "hang_timeout_s": 60.0, **trainer}))
    roles, log = roles or Roles(critic=name == "ppo", prm=name == "prime"), Log()
    scorer = Scorer(a, TOK)
    try:
        train(cfg, roles, stream(), scorer, log, eos_token_ids=[TOK.eos_token_id], pad_token_id=TOK.pad_token_id,
              agent=agent)
    finally:
        scorer.close()
    return roles.events, log.rows


@pytest.mark.parametrize("name", ["grpo", "ppo", "prime"])
def test_both_loops_run_the_same_training_half(name):
    """PRIME's implicit PRM learns from the batch's outcomes (its labels the verifier's reward in
    [0, 1]) before it rewards the tokens, and both come before the actor's update."""
    half = {"ppo": ["old_log_probs", "values", "critic update", "actor update"],
            "prime": ["old_log_probs", "prm update", "process_rewards", "actor update"],
            "grpo": ["old_log_probs", "actor update"]}[name]
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


@pytest.mark.parametrize("train", [loop.train, one_step_off.train], ids=["sync", "one_step_off"])
def test_critic_warmup_trains_the_critic_alone(train):
    """trainer.critic_warmup_steps=2: steps 1 and 2 update the critic only (VAPO's value warm-up);
    the actor moves from step 3, in both loops."""
    events, rows = run(train, "ppo", steps=4, critic_warmup_steps=2)
    updates = [e for e in events if "update" in e]
    assert [e.split(" v")[0] for e in updates] == ["critic update"] * 3 + ["actor update", "critic update",
                                                                           "actor update"]
    assert ["actor/loss" in r for r in rows] == [False, False, True, True]
    assert all("critic/loss" in r for r in rows)


class SplitRoles(Roles):
    """Split placement: the rollout has its own ranks (no memory to trade), generation takes
    ``gen_s`` and the actor's update ``train_s`` seconds, and the log records when each ran."""

    def __init__(self, gen_s=0.05, train_s=0.05):
        super().__init__(critic=False)
        self.gen_s, self.train_s = gen_s, train_s
        self.rollout.release_memory = self.rollout.resume_memory = lambda: None
        self.busy = set()  # what runs now: "generate", "train", "sync"
        self.overlapped = 0

    def _run(self, what, seconds):
        import time

        assert not ({"sync"} | {what}) & self.busy or what == "train" and self.busy == {"generate"}, \
            f"{what} while {self.busy}"  # a sync never meets a generate call; training may
        self.overlapped += bool(self.busy)
        self.busy.add(what)
        time.sleep(seconds)
        self.busy.discard(what)

    def generate(self, prompts, sampling):
        self._run("generate", self.gen_s)
        self.events.append(f"generate v{self.scripted.version}")
        return self.scripted.generate(prompts, sampling)

    def update_weights(self, version):
        self._run("sync", 0.0)
        return super().update_weights(version)

    def forward(self, column, batch):
        self.events.append(column)
        return Columns({column: torch.zeros_like(batch.loss_mask)})

    def update(self, role, batch):
        self._run("train", self.train_s)
        self.events.append(f"{role} update v{batch.policy_version}")
        return {f"{role}/loss": 1.0}


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_split_one_step_off_overlaps_within_the_staleness_bound(bound):
    """A driver thread draws ahead while the actor trains; no batch is older than the bound
    (max_staleness=0: one step off), syncs never interleave with a generate call, and the
    batches are those of the in-line schedule when the bound is one step."""
    roles = SplitRoles(gen_s=0.01, train_s=0.2)  # drawing (scoring included) is far faster than training
    events, rows = run(one_step_off.train, "grpo", steps=6, roles=roles, max_staleness=bound, placement="split")
    limit = bound or 1
    staleness = [r["sampling/staleness"] for r in rows]
    assert staleness[0] == 0 and max(staleness) == min(limit, 5)  # generation outruns training up to the bound
    assert all(0 <= s <= limit for s in staleness)
    assert [r["policy_version"] for r in rows] == [step - 1 - s for step, s in enumerate(staleness, 1)]
    assert roles.overlapped > 0  # generation ran while the actor trained
    assert [e for e in events if e.startswith("sync")] == [f"sync {v}" for v in range(7)]
    assert all(r["time/generate_s"] >= 0.01 for r in rows)  # the draw's own seconds travel with its batch
    if limit == 1:  # the same batches as the colocated (in-line) one-step-off schedule
        _, inline = run(one_step_off.train, "grpo", steps=6)
        assert [r["policy_version"] for r in inline] == [r["policy_version"] for r in rows]


class PartialRoles(SplitRoles):
    """Split placement with partial rollouts: ``begin`` takes the scripted responses, each
    ``advance(k)`` call (``gen_s`` seconds, a generate call as the lock sees it) reveals k more
    tokens of each, stamped with the version the rollout holds then."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rollout.begin, self.rollout.advance = self.begin, self.advance
        self.advances = []  # (the version each advance call ran under)

    def begin(self, prompts, sampling):
        self.pending = [(r, []) for r in self.scripted.generate(prompts, sampling)]

    def advance(self, k):
        self._run("generate", self.gen_s)
        self.advances.append(self.scripted.version)
        done, left = [], []
        for r, versions in self.pending:
            versions = versions + [self.scripted.version] * min(k, r.length - len(versions))
            if len(versions) < r.length:
                left.append((r, versions))
            else:
                done.append(dataclasses.replace(r, policy_version=min(versions),
                                                versions=versions if len(set(versions)) > 1 else None))
        self.pending = left
        return done, len(left)


@pytest.mark.parametrize("bound", [1, 2])
def test_partial_rollouts_let_syncs_in_between_chunks(bound):
    """parallel.rollout.partial_rollout: the drawing thread advances its responses one token at a
    time; the actor's syncs come in between (never during a call: SplitRoles asserts it), so
    responses carry tokens of two versions, the later ones newer. Every token, the oldest
    included, is within the bound, and the token-lag shares add up to 1."""
    roles = PartialRoles(gen_s=0.04, train_s=0.05)  # a draw (3 tokens) spans a step: syncs land inside
    events, rows = run(one_step_off.train, "grpo", steps=6, roles=roles, chunk=1, max_staleness=bound,
                       placement="split")
    staleness = [r["sampling/staleness"] for r in rows]
    assert all(0 <= s <= bound for s in staleness) and max(staleness) >= 1
    assert all(r["sampling/token_staleness_mean"] <= r["sampling/staleness"] for r in rows)
    assert any(r["sampling/token_staleness_mean"] < r["sampling/staleness_mean"] for r in rows)  # newer later tokens
    for r in rows:
        assert sum(r[f"sampling/token_lag_{k}"] for k in range(bound + 1)) == pytest.approx(1.0)
    assert len(set(roles.advances)) > 1 and [e for e in events if e.startswith("sync")] == [f"sync {v}" for v in range(7)]


def test_producer_error_reaches_the_trainer():
    roles = SplitRoles()

    def fail(prompts, sampling):
        raise RuntimeError("rollout rank 1 is gone")

    roles.rollout.generate = fail
    with pytest.raises(RuntimeError, match="rollout rank 1 is gone"):
        run(one_step_off.train, "grpo", steps=3, roles=roles, placement="split")


def test_split_one_step_off_runs_multi_turn_episodes_in_the_drawing_thread():
    """Multi-turn episodes (the agent loop) drawn by the producer thread under split placement:
    every generate call of an episode's turns happens there, each step's batch holds whole
    episodes with their observation tokens masked, within the staleness bound."""
    from megarl.agent.loop import Agent
    from megarl.config.schema import RolloutConfig
    from tests.unit.agent.test_loop import CountingEnv, ScriptedRollout as TurnRollout

    class VersionedTurns(TurnRollout):  # the turns of the weights last synced
        version = 0

        def generate(self, prompts, sampling):
            return [dataclasses.replace(r, policy_version=self.version) for r in super().generate(prompts, sampling)]

    roles = SplitRoles(gen_s=0.0, train_s=0.05)
    roles.scripted = VersionedTurns()
    agent = Agent(RolloutConfig(env="scripted", max_turns=3, max_total_tokens=64), lambda: CountingEnv(turns=3), TOK)
    events, rows = run(one_step_off.train, "grpo", steps=3, roles=roles, agent=agent, placement="split")
    assert [r["agent/turns_mean"] for r in rows] == [3.0, 3.0, 3.0]
    assert all(0 < r["agent/observation_token_frac"] < 1 for r in rows)
    assert [r["sampling/staleness"] for r in rows] == [0, 1, 1]
    assert sum(e.startswith("generate") for e in events) >= 3 * 3  # at least one call per turn per step


def test_split_one_step_off_validates_each_step_on_its_weights_beside_the_drawing_thread():
    """Validation (trainer.val_interval=2) under split placement one step off: after the step's
    sync, on that version's weights, its generate calls under the producer's lock (SplitRoles
    asserts that no sync meets a generate call), while the drawing thread goes on."""
    roles = SplitRoles(gen_s=0.02, train_s=0.1)
    seen = []

    class Validator:
        def run(self, rollout):
            for _ in range(3):  # several calls, as Validator.run makes per chunk of prompts
                rollout.generate([TOK.prompt_ids("12=")], SimpleNamespace(n=1, greedy=True))
                seen.append(roles.scripted.version)
            return {"val/reward/mean@1": 0.5}, []

    class ValLog(Log):
        def validation(self, step, metrics, rows):
            self.rows.append({"validation": step, **metrics})

    a = algo(name="grpo")
    cfg = SimpleNamespace(algorithm=a, data=SimpleNamespace(prompts_per_step=2), parallel=rollout_layout(),
                          trainer=SimpleNamespace(seed=0, train_steps=5, placement="split", max_staleness=0,
                                                  hang_timeout_s=60.0, val_interval=2, val_before_train=True, critic_warmup_steps=0))
    log, scorer = ValLog(), Scorer(a, TOK)
    try:
        one_step_off.train(cfg, roles, stream(), scorer, log, eos_token_ids=[TOK.eos_token_id],
                           pad_token_id=TOK.pad_token_id, validator=Validator())
    finally:
        scorer.close()
    assert [r["validation"] for r in log.rows if "validation" in r] == [0, 2, 4]
    assert seen == [0] * 3 + [2] * 3 + [4] * 3  # each validation on the weights of its step
    assert [r["step"] for r in log.rows if "step" in r] == [1, 2, 3, 4, 5]


def test_a_chunk_waits_for_a_sync_no_longer_than_the_hang_deadline():
    from megarl.trainer.producer import Producer

    producer = Producer(lambda *_: None, None, start=1, last=1, bound=1, threaded=False, chunk=1, deadline_s=0.2)
    producer.syncs_waiting = 1  # a sync that never ends (its ranks hung past their own deadline)
    with pytest.raises(TimeoutError, match=r"weight sync did not finish within trainer.hang_timeout_s=0.2s"):
        producer.yield_to_sync()
    producer.syncs_waiting = 0
    producer.yield_to_sync()  # none waiting: no wait
