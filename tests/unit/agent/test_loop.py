"""The agent loop against a scripted rollout engine and scripted environments: the masks and
log-probs of a multi-turn transcript through make_batch, refilled batches around a slow tool,
the budget cuts, error observations, per-turn seeds, rewards through sample_step."""

from __future__ import annotations

import asyncio
import time
from typing import List

import pytest
import torch

from megarl.agent.env import Environment, StepResult
from megarl.agent.loop import Agent, run_episodes, turn_seed
from megarl.config.schema import AlgorithmConfig, RolloutConfig
from megarl.data.datasets import PromptRecord
from megarl.data.tokenizer import DigitTokenizer
from megarl.rollout.types import Response, RolloutEngine, SamplingParams
from megarl.trainer.steps import PromptStream, make_batch, sample_step

TOK = DigitTokenizer()
EOS = TOK.eos_token_id


class ScriptedRollout(RolloutEngine):
    """Every turn answers "<turn>+<turn>" then EOS (cut at the call's limit); the log-prob of the
    k-th token of a turn is -(k + 1) / 10 - turn / 100 (distinct per position and turn). Records
    each call: (contexts, limit, prompt seeds, time)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling: SamplingParams) -> List[Response]:
        self.calls.append(([list(p) for p in prompts], sampling.max_new_tokens, list(sampling.prompt_seeds),
                           time.perf_counter()))
        out = []
        for i, prompt in enumerate(prompts):
            turn = sum(1 for t in prompt if t == EOS)  # earlier turns each ended at EOS
            ids = (TOK.encode(f"{turn}+{turn}") + [EOS])[: sampling.max_new_tokens]
            out.append(Response(i, 0, ids, [-(k + 1) / 10 - turn / 100 for k in range(len(ids))],
                                "stop" if ids[-1] == EOS else "length", policy_version=3))
        return out

    def update_weights(self, policy_version):
        pass


class CountingEnv(Environment):
    """Answers every turn with "|<turn>|"; done after ``turns`` turns with reward 1; the step of
    turn ``slow_turn`` of the record ``slow`` sleeps ``delay`` s. Logs (record, turn, begin, end)."""

    events: list = []

    def __init__(self, turns=3, slow=None, slow_turn=0, delay=0.0, malformed_turn=None):
        self.turns, self.slow, self.slow_turn, self.delay, self.malformed_turn = turns, slow, slow_turn, delay, malformed_turn
        self.turn = 0
        self.closed = False

    async def reset(self, record):
        self.record = record.source
        return None

    async def step(self, message):
        begin = time.perf_counter()
        turn = self.turn
        self.turn += 1
        assert message == f"{turn}+{turn}"  # the decoded turn, EOS dropped
        if self.record == self.slow and turn == self.slow_turn:
            await asyncio.sleep(self.delay)
        CountingEnv.events.append((self.record, turn, begin, time.perf_counter()))
        if turn == self.malformed_turn:
            return StepResult("|bad call|", info={"tool_error": True})
        if self.turn == self.turns:
            return StepResult("", reward=1.0, done=True)
        return StepResult(f"|{turn}|", reward=0.25, info={"tool": "count"})

    async def close(self):
        self.closed = True


def records(count):
    return [PromptRecord(f"{i}{i}=", "", f"r{i}") for i in range(count)]


def run(engine, env_factory, n=1, count=1, seed=5, max_new=8, **cfg):
    recs = records(count)
    ids = [TOK.prompt_ids(r.prompt) for r in recs]
    sampling = SamplingParams(temperature=1.0, n=n, max_new_tokens=max_new, stop_token_ids=[EOS], seed=seed)
    return recs, ids, run_episodes(engine, recs, ids, sampling, env_factory, TOK, RolloutConfig(env="x", **cfg))


def test_transcript_masks_and_log_probs_through_make_batch():
    engine = ScriptedRollout()
    recs, ids, episodes = run(engine, lambda: CountingEnv(turns=3), n=2)
    turn = lambda k: TOK.encode(f"{k}+{k}") + [EOS]
    want = turn(0) + TOK.encode("|0|") + turn(1) + TOK.encode("|1|") + turn(2)
    mask = [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3 + [1] * 4
    logp = [-.1, -.2, -.3, -.4] + [0] * 3 + [-.11, -.21, -.31, -.41] + [0] * 3 + [-.12, -.22, -.32, -.42]
    assert [(r.prompt_index, r.sample_index) for r in episodes.responses] == [(0, 0), (0, 1)]
    for r in episodes.responses:
        assert (r.token_ids, r.policy_mask, r.finish_reason, r.policy_version) == (want, mask, "stop", 3)
        assert r.log_probs == pytest.approx(logp, abs=1e-12)
        assert r.prompt_ids is None  # no tools, no reset text: the record's prompt
    # each turn's context is the prompt plus the response so far, ids as generated (no re-tokenization)
    contexts = [c for call in engine.calls for c in call[0]]
    assert contexts == [ids[0]] * 2 + [ids[0] + want[:7]] * 2 + [ids[0] + want[:14]] * 2
    assert episodes.rewards.tolist() == [1.5, 1.5]  # 0.25 + 0.25 + 1
    assert [r.token_ids for r in episodes.final_turns] == [turn(2)] * 2
    m = {name: metric.value for name, metric in episodes.metrics.items()}
    assert (m["agent/turns_mean"], m["agent/turns_max"], m["agent/tool_calls_mean"]) == (3, 3, 2)
    assert (m["agent/observation_tokens_mean"], m["agent/ended_done"], m["agent/generate_calls"]) == (6, 1.0, 3)
    assert m["agent/rows_per_call"] == 2 and m["agent/tool_errors_mean"] == 0

    from megarl.trainer.steps import Sampled
    sampled = Sampled(recs, ids, episodes.responses, episodes.rewards, episodes.rewards)
    batch = make_batch(sampled, TOK.pad_token_id)
    start = len(ids[0]) - 1  # the position predicting the first response token
    row_mask = batch.loss_mask[0]
    assert row_mask[:start].sum() == 0 and row_mask[start + len(want):].sum() == 0
    assert row_mask[start:start + len(want)].tolist() == mask
    trained = batch.labels[0][row_mask.bool()].tolist()
    assert trained == turn(0) + turn(1) + turn(2)  # policy tokens only
    assert batch.rollout_log_probs[0][row_mask.bool()].tolist() == pytest.approx(
        [v for v, k in zip(logp, mask) if k], abs=1e-7)
    assert batch.rollout_log_probs[0][start:start + len(want)][torch.tensor(mask) == 0].abs().sum() == 0


def test_a_slow_tool_delays_only_its_episode():
    CountingEnv.events = []
    engine = ScriptedRollout()
    _, ids, episodes = run(engine, lambda: CountingEnv(turns=3, slow="r0", slow_turn=0, delay=0.5), count=3)
    slow_end = next(end for rec, turn, _, end in CountingEnv.events if rec == "r0" and turn == 0)
    for rec in ("r1", "r2"):  # the other episodes ran all three turns while r0 waited on its tool
        assert max(end for r, _, _, end in CountingEnv.events if r == rec) < slow_end
    episode_of = {tuple(p): i for i, p in enumerate(ids)}
    members = [sorted(episode_of[tuple(c[: len(ids[0])])] for c in call[0]) for call in engine.calls]
    assert members[0] == [0, 1, 2] and [1, 2] in members  # refilled: r1 and r2 went on without r0
    r0_calls = [k for k, m in enumerate(members) if 0 in m]
    assert all(engine.calls[k][3] > slow_end for k in r0_calls[1:])  # r0's next turn came after its tool
    assert all(r.length == 3 * 4 + 2 * 3 for r in episodes.responses)  # 3 turns, 2 observations
    # the seeds of each (episode, turn) are those of its position, whoever shared the call
    for call in engine.calls:
        for context, seed in zip(call[0], call[2]):
            episode = episode_of[tuple(context[: len(ids[0])])]
            assert seed == turn_seed(5, episode, sum(1 for t in context if t == EOS))


def test_budget_cuts():
    engine = ScriptedRollout()
    _, _, cut = run(engine, lambda: CountingEnv(turns=5), max_turns=2)
    r = cut.responses[0]
    assert cut.metrics["agent/turns_max"].value == 2 and sum(r.policy_mask) == 8 and r.policy_mask[-1] == 1
    assert cut.metrics["agent/ended_done"].value == 0 and cut.rewards.tolist() == [0.5]

    engine = ScriptedRollout()  # budget 10: turn 4 + obs 3 (7), turn 2 of at most 3 tokens, cut
    _, _, small = run(engine, lambda: CountingEnv(turns=5), max_total_tokens=10)
    r = small.responses[0]
    assert [call[1] for call in engine.calls] == [8, 3]  # min(max_new_tokens, what is left)
    assert r.length == 10 and r.finish_reason == "length" and r.policy_mask == [1] * 4 + [0] * 3 + [1] * 3
    assert small.metrics["agent/ended_budget"].value == 1.0  # the next observation would not fit

    engine = ScriptedRollout()  # budget 7: turn 1 (4) + its observation (3) leave no token: cut
    _, _, fits = run(engine, lambda: CountingEnv(turns=5), max_total_tokens=7)
    assert fits.responses[0].length == 4 and fits.metrics["agent/ended_budget"].value == 1.0


class RaisingEnv(CountingEnv):
    async def step(self, message):
        if self.turn == 0:
            self.turn += 1
            raise RuntimeError("tool crashed")
        if self.turn == 1:
            self.turn += 1
            await asyncio.sleep(5)
        return await super().step(message)


def test_malformed_calls_failures_and_timeouts_are_error_observations():
    engine = ScriptedRollout()
    envs = []
    factory = lambda: envs.append(CountingEnv(turns=3, malformed_turn=0)) or envs[-1]
    _, _, episodes = run(engine, factory)
    r = episodes.responses[0]
    # the digit tokenizer keeps the characters it has of the error text
    assert TOK.decode(r.token_ids) == "0+0| |1+1|1|2+2" and r.finish_reason == "stop"
    assert episodes.metrics["agent/tool_errors_mean"].value == 1 and envs[0].closed

    engine = ScriptedRollout()
    _, _, episodes = run(engine, lambda: RaisingEnv(turns=4), max_turns=3, max_tool_seconds=0.2)
    assert episodes.metrics["agent/tool_errors_mean"].value == 2 and episodes.metrics["agent/turns_max"].value == 3


class FailingResetEnv(CountingEnv):
    async def reset(self, record):
        raise ValueError("no such puzzle")


def test_a_failing_reset_fails_the_call_with_its_own_error():
    with pytest.raises(ValueError, match="no such puzzle"):
        run(ScriptedRollout(), FailingResetEnv, count=2)


class ScoreFinal:
    """A Scorer stand-in: 1 where the text is "2+2" (records the texts)."""

    def __init__(self):
        self.texts = []

    def __call__(self, recs, responses, ids=()):
        texts = [TOK.decode(r.token_ids) for r in responses]
        self.texts += texts
        return torch.tensor([float(t == "2+2") for t in texts])

    def take_metrics(self):
        return {}


@pytest.mark.parametrize("reward", ["env", "verifier"])
def test_sample_step_rewards_and_overlong_budget(reward):
    algo = AlgorithmConfig(samples_per_prompt=2, max_new_tokens=8, overlong_buffer=4, overlong_penalty=1.0)
    stream = PromptStream(records(3), TOK, seed=0, max_prompt_tokens=32)
    agent = Agent(RolloutConfig(env="x", reward=reward, max_total_tokens=20), lambda: CountingEnv(turns=3), TOK)
    scorer = ScoreFinal()
    sampled = sample_step(ScriptedRollout(), stream, scorer, algo, 2, seed=1, eos_token_ids=[EOS], agent=agent)
    assert len(sampled.responses) == 4 and all(r.length == 18 for r in sampled.responses)
    # DAPO's overlong shaping counts against the episode budget: 18 > 20 - 4 by 2 -> -0.5
    raw = 1.5 if reward == "env" else 1.0
    assert sampled.raw_scores.tolist() == [raw] * 4
    assert sampled.scores.tolist() == pytest.approx([raw - 0.5] * 4)
    assert scorer.texts == ([] if reward == "env" else ["2+2"] * 4)  # the final turn only
    assert sampled.agent_metrics["agent/turns_mean"] == 3


def test_engines_seed_an_episode_turn_alone():
    """Per-prompt seeds make a row's draws independent of the call's other rows: the SGLang
    request seed and the native engine's stream (sampling.stream_key) follow the prompt's seed."""
    from megarl.rollout.sampling import row_key, row_keys, uniforms
    from megarl.rollout.sglang_engine import request_params

    together = SamplingParams(seed=3, prompt_seeds=[11, 22])
    alone = SamplingParams(seed=9, prompt_seeds=[22])
    assert request_params([(0, 0), (1, 0)], together)[1] == request_params([(0, 0)], alone)[0]
    assert request_params([(0, 0)], together)[0]["sampling_seed"] != request_params([(0, 0)], alone)[0]["sampling_seed"]
    draw = lambda sampling, p: uniforms(row_keys([row_key(*sampling.stream_key(sampling.seed, p), 0)]), torch.arange(4))
    assert torch.equal(draw(together, 1), draw(alone, 0)) and not torch.equal(draw(together, 0), draw(alone, 0))
    plain = SamplingParams(seed=3)  # no prompt seeds: (seed, prompt index) as before
    assert plain.stream_key(3, 1) == (3, 1)
