"""Sample-level streaming (trainer.loop=async) against a scripted rollout with a long tail: the
pool is topped up to max_inflight, groups stay whole, every token is within the staleness bound
under ``wait`` (none dropped) and stale groups are dropped under ``drop``; syncs come between
chunks (partial) or after the pool drains; dynamic sampling filters at the queue; the checkpoint's
stream state resumes with no prompt lost or trained twice."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from megarl.config.schema import StalenessPolicy
from megarl.trainer import streaming
from megarl.trainer.steps import Scorer
from tests.unit.test_loops import Log, SplitRoles
from tests.unit.test_trainer_steps import TOK, algo, stream

LONG = 12  # tokens of a long-tailed response (every 4th prompt's); the others end after 3


class StreamingRoles(SplitRoles):
    """A rollout that takes requests into its pool (``admit``) and reveals ``k`` tokens of each per
    ``advance(k)`` call (``gen_s`` seconds), each stamped with the version it holds then; every
    4th prompt's responses are long. The digits answer as ScriptedRollout's (reward signal in odd
    prompts' groups)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rollout.admit, self.rollout.advance = self.admit, self.advance
        self.pending = []  # [response, versions so far]
        self.admitted = []  # prompt texts, in admission order
        self.peak = 0
        self.syncs_mid_flight = 0

    def admit(self, prompts, sampling, first_index):
        self.admitted += [TOK.decode(p) for p in prompts]
        for r in self.scripted.generate(prompts, sampling):
            k = int(TOK.decode(prompts[r.prompt_index])[:-1])
            ids = r.token_ids  # every 4th prompt (even: one reward per group) answers at length
            if k % 4 == 0:
                ids = (ids[:-1] * LONG)[:LONG - 1] + [TOK.eos_token_id]
            length = len(ids)
            r = dataclasses.replace(r, prompt_index=first_index + r.prompt_index, token_ids=ids,
                                    log_probs=[-0.5] * length)
            self.pending.append([r, []])
        self.peak = max(self.peak, len(self.pending))

    def advance(self, k):
        self._run("generate", self.gen_s)
        done, left = [], []
        for r, versions in self.pending:
            versions = versions + [self.scripted.version] * min(k, r.length - len(versions))
            if len(versions) < r.length:
                left.append([r, versions])
            else:
                done.append(dataclasses.replace(r, policy_version=min(versions),
                                                versions=versions if len(set(versions)) > 1 else None))
        self.pending = left
        return done[::-1], len(left)  # not in sample order: the engine reports them as they end

    def update_weights(self, version):
        self.syncs_mid_flight += bool(self.pending)
        return super().update_weights(version)


def config(steps, bound, policy, partial=True, dynamic=False, inflight=0, **trainer):
    a = algo(name="dapo" if dynamic else "grpo", dynamic_sampling=dynamic, max_sampling_rounds=3)
    return SimpleNamespace(
        algorithm=a, data=SimpleNamespace(prompts_per_step=2),
        parallel=SimpleNamespace(rollout=SimpleNamespace(partial_rollout=partial, partial_chunk_tokens=1,
                                                         max_inflight=inflight)),
        trainer=SimpleNamespace(seed=0, train_steps=steps, max_staleness=bound, staleness_policy=policy,
                                critic_warmup_steps=0, hang_timeout_s=30.0, **trainer))


def run(cfg, roles, prompts=None, start_step=1, marks=None):
    scorer, log = Scorer(cfg.algorithm, TOK), Log()
    prompts = prompts or stream()
    trained = []
    real_step = log.step

    def step(s, batch, metrics):
        trained.extend(TOK.decode(p) for p in batch.prompt_ids[::cfg.algorithm.samples_per_prompt])
        for prompt, response, score in zip(batch.prompt_ids, batch.response_ids, batch.raw_scores.tolist()):
            right = response == TOK.encode(TOK.decode(prompt)[:-1]) + [TOK.eos_token_id]
            assert score == float(right), (TOK.decode(prompt), response, score)  # each row its own reward
        real_step(s, batch, metrics)

    log.step = step
    try:
        streaming.train(cfg, roles, prompts, scorer, log, eos_token_ids=[TOK.eos_token_id],
                        pad_token_id=TOK.pad_token_id, start_step=start_step,
                        after_step=(lambda s: marks.__setitem__(s, prompts.state_after(s))) if marks is not None else None)
    finally:
        scorer.close()
    return log.rows, trained


@pytest.mark.parametrize("bound", [1, 2])
def test_wait_keeps_every_token_within_the_bound_and_drops_nothing(bound):
    roles = StreamingRoles(gen_s=0.005, train_s=0.05)
    rows, trained = run(config(8, bound, StalenessPolicy.wait, inflight=16), roles)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["sampling/staleness"] <= bound for r in rows)  # the oldest token of every row
    assert max(r["sampling/staleness"] for r in rows) >= 1  # generation ran ahead of the actor
    assert all(r["sampling/stale_dropped_groups"] == 0 for r in rows)
    assert trained == roles.admitted[:len(trained)]  # trained in admission order
    assert len(trained) == 16 and len(set(trained)) == 16  # whole groups, none twice
    assert roles.peak <= 16  # the pool never above max_inflight rows
    assert roles.syncs_mid_flight > 0  # partial rollouts: syncs came between chunks
    assert any(r["sampling/mixed_rows"] > 0 for r in rows)
    for r in rows:
        assert sum(r[f"sampling/token_lag_{k}"] for k in range(bound + 1)) == pytest.approx(1.0)


def test_drop_trains_groups_as_they_finish_and_drops_stale_ones():
    """Short responses overtake the long tail; a long group that ends too old is dropped."""
    roles = StreamingRoles(gen_s=0.01, train_s=0.02)
    rows, trained = run(config(6, 1, StalenessPolicy.drop, inflight=24), roles)
    assert all(r["sampling/staleness"] <= 1 for r in rows)  # what was trained is within the bound
    assert trained != roles.admitted[:len(trained)]  # completion order, not admission order
    dropped = sum(r["sampling/stale_dropped_groups"] for r in rows)
    assert dropped > 0 and all(0 <= r["sampling/stale_dropped_frac"] < 1 for r in rows)
    assert len(set(trained)) == len(trained) == 12


def test_without_partial_rollouts_a_sync_waits_for_the_pool_to_drain():
    roles = StreamingRoles(gen_s=0.002, train_s=0.02)
    rows, _ = run(config(4, 1, StalenessPolicy.wait, partial=False, inflight=8), roles)
    assert roles.syncs_mid_flight == 0
    assert all(r["sampling/mixed_rows"] == 0 for r in rows)


def test_dynamic_sampling_filters_at_the_queue():
    roles = StreamingRoles(gen_s=0.0, train_s=0.01)
    rows, trained = run(config(4, 1, StalenessPolicy.wait, dynamic=True, inflight=16), roles)
    assert all(int(p[:-1]) % 2 == 1 for p in trained)  # only groups with a reward signal (odd prompts)
    assert sum(r["sampling/dropped_groups"] for r in rows) > 0


def test_prime_accuracy_filter_filters_at_the_queue():
    """filter_accuracy at the queue: only groups of mean accuracy in [0.2, 0.8] (the odd prompts,
    half right) are trained, within the oversampled budget; the share kept is logged."""
    cfg = config(4, 1, StalenessPolicy.wait, inflight=16)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, filter_accuracy=True)
    rows, trained = run(cfg, StreamingRoles(gen_s=0.0, train_s=0.01))
    assert all(int(p[:-1]) % 2 == 1 for p in trained)
    assert sum(r["sampling/dropped_groups"] for r in rows) > 0
    fracs = [r["sampling/accuracy_kept_frac"] for r in rows if "sampling/accuracy_kept_frac" in r]
    assert fracs and all(0 <= f <= 1 for f in fracs) and min(fracs) < 1


@pytest.mark.parametrize("policy", [StalenessPolicy.wait, StalenessPolicy.drop])
def test_resume_from_a_step_loses_and_repeats_no_prompt(policy):
    """The checkpoint of step 3 (groups in flight and queued) resumed: the prompts trained before it
    and after it together are each trained once, and none of the stream's is skipped."""
    marks = {}
    first = StreamingRoles(gen_s=0.003, train_s=0.02)
    prompts = stream()
    _, trained = run(config(3, 1, policy, inflight=16), first, prompts, marks=marks)
    resumed_stream = stream()
    resumed_stream.load_state(marks[3])
    second = StreamingRoles(gen_s=0.003, train_s=0.02)
    second.scripted.version = 2
    _, more = run(config(6, 1, policy, inflight=16), second, resumed_stream, start_step=4)
    both = trained + more
    assert len(both) == len(set(both)) == 12  # none twice
    if policy == StalenessPolicy.wait:  # admission order: exactly the stream's first 12
        reference = stream()
        assert sorted(both) == sorted(reference.tokenizer.decode(reference.token_ids(r)) for r in reference.next(12))
    assert second.admitted[0] not in trained  # the resumed run starts with a prompt not trained before


def test_max_staleness_0_admits_each_step_whole_with_the_sync_loops_seeds():
    """On policy: every token of every step is from the actor's own version, each step's groups
    are admitted in one call once that version is synced, seeded as sample_step seeds the step."""
    roles = StreamingRoles(gen_s=0.002, train_s=0.02)
    seeds, admit = [], roles.rollout.admit
    roles.rollout.admit = lambda prompts, sampling, first: seeds.append((len(prompts), first, sampling.seed)) or \
        admit(prompts, sampling, first)
    rows, trained = run(config(4, 0, StalenessPolicy.wait, partial=False), roles)
    assert all(r["sampling/staleness"] == 0 and r["sampling/token_lag_0"] == 1.0 for r in rows)
    assert seeds == [(2, 2 * k, (0 + k + 1) * 1000) for k in range(4)]  # trainer.seed 0: (seed + step) * 1000
    assert trained == roles.admitted


def test_a_failing_rollout_reaches_the_trainer():
    roles = StreamingRoles()

    def fail(k):
        raise RuntimeError("rollout rank 1 is gone")

    roles.rollout.advance = fail
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="rollout rank 1 is gone"):
        run(config(2, 1, StalenessPolicy.wait), roles)
    assert time.perf_counter() - start < 10
