"""The agent loop: many multi-turn episodes at once against one :class:`RolloutEngine`.

One asyncio event loop in the driver runs a coroutine per episode (generate a turn → the
environment's step → append its observation → next turn) and a batcher that gathers every
episode waiting for a turn into one ``rollout.generate`` call, run in a worker thread. While a
call generates, episodes whose tools finish queue for the next one (refilled batches); an
episode waiting on a slow tool delays only itself. Token ids are kept exactly as generated,
plus the observation's ids as tokenized (:class:`ChatCodec`): the transcript is never
re-tokenized, so the trainer's log-probs of a sample are those of the rollout. Each turn's
draws are seeded by (step seed, episode, turn), so they do not depend on which episodes share
the call (which depends on tool timing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megarl.agent.chat import ChatCodec
from megarl.agent.env import Environment, StepResult
from megarl.config.schema import EpisodeReward
from megarl.data.datasets import PromptRecord
from megarl.metrics import Metric, Reduce
from megarl.rollout.types import Response, SamplingParams

log = logging.getLogger(__name__)

REWARDS = tuple(EpisodeReward)  # rollout.reward
# How long the batcher waits for episodes still in their tools to join a call: far below one
# generation call's time, so a slow tool costs the others at most this much.
GATHER_S = 0.02


def total_budget(cfg, max_new_tokens: int) -> int:
    """``rollout.max_total_tokens``, null meaning max_turns x the per-turn limit."""
    return cfg.max_total_tokens if cfg.max_total_tokens is not None else cfg.max_turns * max_new_tokens


def check_config(cfg, max_new_tokens: int) -> None:
    """The ``rollout:`` section's values (ValueError naming the key)."""
    if cfg.reward not in REWARDS:
        raise ValueError(f"rollout.reward='{cfg.reward}' must be one of {EpisodeReward.allowed()}")
    if cfg.max_turns < 1 or cfg.max_tool_seconds <= 0:
        raise ValueError(f"rollout.max_turns={cfg.max_turns} must be >= 1 and rollout.max_tool_seconds="
                         f"{cfg.max_tool_seconds} > 0")
    if total_budget(cfg, max_new_tokens) < 1:
        raise ValueError(f"rollout.max_total_tokens={cfg.max_total_tokens} must be >= 1")


def turn_seed(seed: Optional[int], episode: int, turn: int) -> int:
    """The seed of one episode's turn (hash of a tuple of ints: stable across processes)."""
    return hash((0 if seed is None else seed, episode, turn)) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class Episodes:
    """One call's episodes, prompt-major (``n`` per record), as ``generate`` orders responses."""

    responses: List[Response]
    rewards: torch.Tensor  # [rows] the sum of each episode's step rewards
    final_turns: List[Response]  # each episode's last policy turn alone (for verifiers on the final answer)
    metrics: Dict[str, Metric] = field(default_factory=dict)  # reduced over rounds by megarl.metrics.merge


@dataclass
class _Request:
    context: List[int]
    limit: int
    seed: int
    future: asyncio.Future


class _Batcher:
    """Gathers the episodes waiting for a turn into ``generate`` calls, one at a time."""

    def __init__(self, rollout, sampling: SamplingParams, live: int):
        self.rollout, self.sampling, self.live = rollout, sampling, live
        self.pending: List[_Request] = []
        self.arrived = asyncio.Event()
        self.calls = self.rows = 0

    async def turn(self, context: List[int], limit: int, seed: int) -> Response:
        request = _Request(context, limit, seed, asyncio.get_running_loop().create_future())
        self.pending.append(request)
        self.arrived.set()
        return await request.future

    def finished(self) -> None:
        self.live -= 1
        self.arrived.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.live:
            await self.arrived.wait()
            self.arrived.clear()
            deadline = loop.time() + GATHER_S
            while self.pending and len(self.pending) < self.live and loop.time() < deadline:
                try:  # give episodes just leaving their tools a moment to join this call
                    await asyncio.wait_for(self.arrived.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    break
                self.arrived.clear()
            if not self.pending:
                continue
            batch, self.pending = self.pending, []
            try:
                responses = await asyncio.to_thread(self._generate, batch)
            except BaseException as err:
                for request in batch:
                    request.future.set_exception(err)
                raise
            for request, response in zip(batch, responses):
                request.future.set_result(response)

    def _generate(self, batch: List[_Request]) -> List[Response]:
        """One ``generate`` per distinct turn limit (near the budget's end limits differ)."""
        out: List[Optional[Response]] = [None] * len(batch)
        for limit in sorted({r.limit for r in batch}, reverse=True):
            rows = [i for i, r in enumerate(batch) if r.limit == limit]
            sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=limit,
                                           prompt_seeds=[batch[i].seed for i in rows])
            for i, response in zip(rows, self.rollout.generate([batch[i].context for i in rows], sampling)):
                out[i] = response
            self.calls += 1
            self.rows += len(rows)
        return out


@dataclass
class _Stats:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    steps: int = 0
    observation_tokens: int = 0
    ended: str = "max_turns"  # done | max_turns | budget


class _Runner:
    def __init__(self, rollout, sampling: SamplingParams, env_factory: Callable[[], Environment], tokenizer,
                 cfg, codec: Optional[ChatCodec]):
        self.sampling, self.env_factory, self.tokenizer, self.cfg = sampling, env_factory, tokenizer, cfg
        self.codec = codec or ChatCodec(tokenizer)
        self.budget = total_budget(cfg, sampling.max_new_tokens)
        self.rollout = rollout

    async def run(self, records: Sequence[PromptRecord], prompt_ids: Sequence[Sequence[int]]):
        n = self.sampling.n
        self.batcher = _Batcher(self.rollout, self.sampling, len(records) * n)
        tasks = []
        async with asyncio.TaskGroup() as group:  # a failing episode cancels the rest
            batcher = group.create_task(self.batcher.run())
            for p, record in enumerate(records):
                for s in range(n):
                    tasks.append(group.create_task(self._episode(p, s, p * n + s, record, list(prompt_ids[p]))))
            await asyncio.gather(*tasks)
            await batcher
        return [t.result() for t in tasks]

    async def _step(self, env: Environment, text: str, stats: _Stats) -> StepResult:
        """The environment's answer to one turn; a timeout or an exception becomes an error
        observation (the episode goes on; environments report malformed calls themselves)."""
        begin = time.perf_counter()
        try:
            result = await asyncio.wait_for(env.step(text), self.cfg.max_tool_seconds)
        except asyncio.TimeoutError:
            result = StepResult(f"error: the tool timed out after {self.cfg.max_tool_seconds:g} s",
                                info={"tool_error": True})
        except Exception as err:  # an environment's bug must not end the other episodes
            log.warning("environment %s failed in step: %r", type(env).__name__, err)
            result = StepResult(f"error: {type(err).__name__}: {err}", info={"tool_error": True})
        seconds = time.perf_counter() - begin
        stats.steps += 1
        stats.tool_seconds += seconds
        if "tool" in result.info or result.info.get("tool_error"):
            stats.tool_calls += 1
        if result.info.get("tool_error"):
            stats.tool_errors += 1
        return result

    async def _episode(self, p: int, s: int, index: int, record: PromptRecord, prompt: List[int]):
        env = self.env_factory()
        stats = _Stats()
        tokens: List[int] = []
        log_probs: List[float] = []
        mask: List[int] = []
        reward, final, versions, finish = 0.0, (0, 0), [], "length"
        try:
            extra = await env.reset(record)
            tools = list(env.tools or [])
            context = prompt if extra is None and not tools else self.codec.prompt_ids(record.prompt, tools, extra)
            for turn in range(self.cfg.max_turns):
                limit = min(self.sampling.max_new_tokens, self.budget - len(tokens))
                response = await self.batcher.turn(context + tokens, limit, turn_seed(self.sampling.seed, index, turn))
                final = (len(tokens), len(tokens) + response.length)
                tokens += response.token_ids
                log_probs += response.log_probs
                mask += [1] * response.length
                finish = response.finish_reason
                versions.append(response.policy_version)
                stats.turns += 1
                result = await self._step(env, self.tokenizer.decode(response.token_ids), stats)
                reward += result.reward
                if result.done:
                    stats.ended = "done"
                    break
                if turn + 1 == self.cfg.max_turns:
                    break
                last = response.token_ids[-1] if finish == "stop" else None
                observation = self.codec.observation_ids(result.observation, last)
                if len(tokens) + len(observation) >= self.budget:  # no room for it and one more token
                    stats.ended, finish = "budget", "length"
                    break
                tokens += observation
                log_probs += [0.0] * len(observation)
                mask += [0] * len(observation)
                stats.observation_tokens += len(observation)
        finally:
            self.batcher.finished()
            await env.close()
        episode = Response(p, s, tokens, log_probs, finish, policy_version=min(versions), policy_mask=mask,
                           prompt_ids=None if context == prompt else context)
        last_turn = Response(p, s, tokens[final[0]:final[1]], log_probs[final[0]:final[1]], finish,
                             policy_version=episode.policy_version, prompt_ids=episode.prompt_ids)
        return episode, last_turn, reward, stats


def run_episodes(rollout, records: Sequence[PromptRecord], prompt_ids: Sequence[Sequence[int]],
                 sampling: SamplingParams, env_factory: Callable[[], Environment], tokenizer, cfg,
                 codec: Optional[ChatCodec] = None) -> Episodes:
    """``sampling.n`` episodes per record, each with its own environment from ``env_factory``;
    turns of at most ``sampling.max_new_tokens`` tokens, ending at ``sampling.stop_token_ids``;
    ``cfg`` is the ``rollout:`` section (max_turns, max_total_tokens, max_tool_seconds). Runs its
    own event loop: call it from a thread without one."""
    runner = _Runner(rollout, sampling, env_factory, tokenizer, cfg, codec)
    try:
        results = asyncio.run(runner.run(records, prompt_ids))
    except BaseExceptionGroup as failed:  # the task group's: the first failure, as itself
        raise failed.exceptions[0]
    stats = [r[3] for r in results]
    rows = len(results)
    policy = sum(sum(r[0].policy_mask) for r in results)
    observed = sum(s.observation_tokens for s in stats)
    steps = sum(s.steps for s in stats)
    metrics = {  # over a step's sampling rounds: per-episode means average, maxima stay maxima, counts add up
        "agent/turns_mean": Metric(sum(s.turns for s in stats) / rows),
        "agent/turns_max": Metric(max(s.turns for s in stats), Reduce.MAX),
        "agent/tool_calls_mean": Metric(sum(s.tool_calls for s in stats) / rows),
        "agent/tool_errors_mean": Metric(sum(s.tool_errors for s in stats) / rows),
        "agent/observation_tokens_mean": Metric(observed / rows),
        "agent/observation_token_frac": Metric(observed / max(observed + policy, 1)),
        "agent/ended_done": Metric(sum(s.ended == "done" for s in stats) / rows),
        "agent/ended_budget": Metric(sum(s.ended == "budget" for s in stats) / rows),
        "agent/generate_calls": Metric(runner.batcher.calls, Reduce.SUM),
        "agent/rows_per_call": Metric(runner.batcher.rows / max(runner.batcher.calls, 1)),
        "time/tool_s": Metric(sum(s.tool_seconds for s in stats), Reduce.SUM),
        "time/tool_step_s": Metric(sum(s.tool_seconds for s in stats) / max(steps, 1)),
    }
    return Episodes([r[0] for r in results], torch.tensor([r[2] for r in results], dtype=torch.float32),
                    [r[1] for r in results], metrics)


class Agent:
    """What ``sample_step`` needs for multi-turn samples: the ``rollout:`` section, a new
    environment per episode, the tokenizer (and its observation codec, built once)."""

    def __init__(self, cfg, env_factory: Callable[[], Environment], tokenizer):
        self.cfg, self.env_factory, self.tokenizer = cfg, env_factory, tokenizer
        self.codec = ChatCodec(tokenizer)

    def budget(self, max_new_tokens: int) -> int:
        return total_budget(self.cfg, max_new_tokens)

    def run(self, rollout, records: Sequence[PromptRecord], prompt_ids: Sequence[Sequence[int]],
            sampling: SamplingParams) -> Episodes:
        return run_episodes(rollout, records, prompt_ids, sampling, self.env_factory, self.tokenizer, self.cfg,
                            self.codec)

