"""Sample-level streaming (``trainer.loop=async``, split placement): the rollout keeps a pool of
requests in flight and the trainer takes whole groups as soon as they are scored.

A driver thread (:class:`SamplePool`) tops the rollout up, one GRPO group (a prompt's
``samples_per_prompt`` requests) at a time, to ``parallel.rollout.max_inflight`` rows, and
advances every request ``partial_chunk_tokens`` tokens per call. A group whose samples have all
ended is scored; under dynamic sampling (DAPO) a group without a reward signal is filtered out
here, at the queue. The trainer takes ``data.prompts_per_step`` groups per step.

Staleness (every token carries the policy version that sampled it): a group admitted while the
rollout holds version v is admitted only if it is within the first (v - v0 + N + 1) x
prompts_per_step groups still to be trained (v0 the version the run started from, N =
``trainer.max_staleness``), so that, trained in admission order, its oldest token is at most N
versions behind the actor (AReaL's admission rule). N = 0 is on policy: each step's groups are
admitted once the weights they are trained against are synced, all at once, drawn with the
synchronous loop's seeds, so the loop is the synchronous one (its samples, metrics and weights).
``trainer.staleness_policy``:

* ``wait``: groups are trained in admission order; the trainer waits for a long-tailed group
  rather than let it age: nothing is dropped and the bound holds for every token;
* ``drop``: groups are trained in the order they finish (short ones overtake long ones); one that
  would be more than N versions old is dropped (``sampling/stale_dropped_groups``).

Weight syncs: with ``parallel.rollout.partial_rollout`` a sync runs between two chunks and the
requests in flight continue under the new weights; without it, admission stops and the requests
in flight finish first (the pool drains), then the sync runs.

Resume: each step's checkpoint records the prompt stream as it was before the oldest group not yet
trained, and the stream positions of the groups after it that were (trained, filtered or
dropped): a resumed run draws the others again and passes over those, so no prompt is lost or
trained twice.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from typing import Dict, List, Optional, Tuple

import torch

from megarl.config.schema import StalenessPolicy
from megarl.rollout.types import Response, SamplingParams
from megarl.trainer.loop import validate
from megarl.trainer.producer import READY_POLL_S, LockedRollout, Producer
from megarl.trainer.steps import (Sampled, kept_groups, make_batch, overlong_penalty, sampling_metrics,
                                  staleness_metrics, train_on)


@dataclasses.dataclass(eq=False)
class Group:
    """One prompt's requests: admitted, then scored."""

    index: int  # admission order in this run
    position: int  # the prompt's position in the stream
    state: Dict  # the stream's state before the prompt was drawn
    record: object
    ids: List[int]
    responses: List[Response] = dataclasses.field(default_factory=list)
    shaped: Optional[torch.Tensor] = None
    raw: Optional[torch.Tensor] = None

    @property
    def oldest(self) -> int:
        return min(v for r in self.responses for v in r.token_versions)


class SamplePool(Producer):
    """The drawing thread of sample-level streaming and the queue between it and the trainer
    (:meth:`take`); weight syncs through :meth:`Producer.sync`, between two of its calls."""

    def __init__(self, rollout, stream, scorer, algo, eos_token_ids, start: int, last: int, prompts_per_step: int,
                 bound: int, policy: StalenessPolicy, max_inflight: int, chunk: int, partial: bool,
                 deadline_s: float, seed: int):
        self.stream, self.scorer, self.algo, self.per_step = stream, scorer, algo, prompts_per_step
        self.policy, self.partial, self.max_inflight = policy, partial, max_inflight
        self.sampling = SamplingParams(temperature=algo.temperature, top_p=algo.top_p, top_k=algo.top_k,
                                       n=algo.samples_per_prompt, max_new_tokens=algo.max_new_tokens,
                                       stop_token_ids=list(eos_token_ids))
        self.seed, self.start_version = seed, start - 1
        self.needed = (last - start + 1) * prompts_per_step  # groups the run trains
        # filtered groups beyond this many fill steps anyway (as sample_step's rounds and oversampled draw)
        self.filter_budget = math.ceil(self.needed * ((algo.max_sampling_rounds - 1 if algo.dynamic_sampling else 0)
                                                      + (algo.oversample_factor - 1 if algo.filter_accuracy else 0)))
        self.admitted = 0
        self.live: Dict[int, Group] = {}  # admitted, not yet trained, filtered or dropped
        self.resolved: set = set()  # positions of groups trained, filtered or dropped
        self.finished: Dict[int, Optional[Group]] = {}  # index -> a scored group, or None (filtered)
        self.done_order: deque = deque()  # indices of scored groups as they finished (policy drop)
        self.next_index = 0  # policy wait: the next group to train, in admission order
        self.taken = 0  # groups handed to the trainer
        self.rows_in_flight = 0
        self.counts = {"filtered": 0, "stale": 0}
        self.filtered_since = 0  # filtered groups since the last take
        self.scored_since = self.passed_since = 0  # groups scored, and those the filters keep, since then
        self.reward_counts: Dict[str, float] = {}
        self.busy = {"generate": 0.0, "reward": 0.0}
        self.idle_s = 0.0  # the rollout with nothing in flight (waiting for admission or a sync)
        self.since = time.perf_counter()
        super().__init__(None, rollout, start, last, bound, threaded=True, chunk=chunk, deadline_s=deadline_s)

    # ------------------------------------------------------------------------ the drawing thread
    def _run(self) -> None:
        try:
            while not self.stopped:
                self._admit()
                if self.rows_in_flight == 0:
                    self._idle()
                    continue
                if self.partial:
                    self.yield_to_sync()  # a waiting sync goes first; the requests continue after it
                start = time.perf_counter()
                done, left = self._call(self.rollout.advance, self.chunk)
                self.busy["generate"] += time.perf_counter() - start
                with self.changed:
                    self.rows_in_flight = left
                    self.changed.notify_all()  # a sync waiting for the pool to drain
                self._collect(done)
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            with self.changed:
                self.failed = self.failed or err
                self.changed.notify_all()

    def _call(self, fn, *args):
        with self.lock:
            try:
                return fn(*args)
            except BaseException as err:
                self.failed = err
                raise

    def _may_admit(self) -> bool:
        """Room in the pool, and the next group would be trained within the staleness bound of the
        weights it starts under (see the module docstring); never while a sync waits for the pool
        to drain (without partial rollouts)."""
        n = self.sampling.n
        if self.rows_in_flight + n > self.max_inflight or (self.syncs_waiting and not self.partial):
            return False
        pending = self.admitted - self.counts["filtered"] - self.counts["stale"]  # groups that will be trained
        return pending < min(self.needed, (self.version - self.start_version + self.bound + 1) * self.per_step)

    def _admit(self) -> None:
        new: List[Group] = []
        with self.changed:
            while self._may_admit():
                state = self.stream.state()
                position = state["position"]
                record = self.stream.next(1)[0]
                while position in state["skip"]:  # passed over by next(): a resumed run's trained prompt
                    position += 1
                group = Group(self.admitted, position, state, record, self.stream.token_ids(record))
                self.live[group.index] = group
                self.admitted += 1
                self.rows_in_flight += self.sampling.n
                new.append(group)
        if new:
            sampling = dataclasses.replace(self.sampling, seed=self._admission_seed(new[0].index, len(new)))
            self._call(self.rollout.admit, [g.ids for g in new], sampling, new[0].index)

    def _admission_seed(self, first: int, count: int) -> int:
        """The seed of an admission's draws. One that holds exactly one step's groups, from a step's
        first, draws with the seed the synchronous loop gives that step (sample_step: (seed + step)
        x 1000, its prompts numbered from 0 in the call, as here): at max_staleness=0, where every
        admission is one whole step's, the two loops draw the same samples. Any other admission gets
        a seed of its own, never a multiple of 1000."""
        if count == self.per_step and first % self.per_step == 0:
            return (self.seed + self.start_version + 1 + first // self.per_step) * 1000
        return (self.seed * 1000003 + first) * 1000 + 999

    def _idle(self) -> None:
        """Nothing in flight: wait for what lets the pool admit again (a weight sync, the trainer)."""
        start = time.perf_counter()
        with self.changed:
            self.changed.wait_for(lambda: self.stopped or (self._may_admit() and self.admitted_left()),
                                  timeout=READY_POLL_S)
        self.idle_s += time.perf_counter() - start

    def admitted_left(self) -> bool:
        return self.admitted - self.counts["filtered"] - self.counts["stale"] < self.needed

    def _collect(self, done: List[Response]) -> None:
        """File the responses that ended under their groups; score the groups now complete."""
        complete = []
        for r in done:
            group = self.live[r.prompt_index]
            group.responses.append(r)
            if len(group.responses) == self.sampling.n:
                group.responses.sort(key=lambda r: r.sample_index)  # scored, trained and dumped in this order
                complete.append(group)
        if not complete:
            return
        start = time.perf_counter()
        responses = [dataclasses.replace(r, prompt_index=k) for k, g in enumerate(complete) for r in g.responses]
        raw = self.scorer([g.record for g in complete], responses, [g.ids for g in complete])
        lengths = torch.tensor([r.length for r in responses])
        algo = self.algo
        shaped = raw + overlong_penalty(lengths, algo.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        group_of = torch.tensor([r.prompt_index for r in responses])
        keep = kept_groups(algo, shaped, raw, group_of)
        self.busy["reward"] += time.perf_counter() - start
        with self.changed:
            self.scored_since += len(complete)
            self.passed_since += int(keep.sum())
            for k, group in enumerate(complete):
                group.shaped, group.raw = shaped[group_of == k], raw[group_of == k]
                if not keep[k] and self.counts["filtered"] < self.filter_budget:
                    self.counts["filtered"] += 1
                    self.filtered_since += 1
                    self._resolve(group)
                    self.finished[group.index] = None
                else:
                    self.finished[group.index] = group
                    self.done_order.append(group.index)
            for key, value in self.scorer.take_metrics().items():
                self.reward_counts[key] = self.reward_counts.get(key, 0) + value
            self.changed.notify_all()

    def _resolve(self, group: Group) -> None:
        del self.live[group.index]
        self.resolved.add(group.position)

    def _before_sync(self) -> None:
        """Without partial rollouts a sync waits for the requests in flight to finish (admission has
        stopped: ``syncs_waiting``), with the run's hang deadline."""
        if self.partial:
            return
        with self.changed:
            if not self.changed.wait_for(lambda: self.rows_in_flight == 0 or self.failed is not None,
                                         timeout=self.deadline_s):
                raise TimeoutError(f"a weight sync waited trainer.hang_timeout_s={self.deadline_s:g}s for the "
                                   f"rollout's {self.rows_in_flight} requests in flight to finish")

    # ----------------------------------------------------------------------------- the trainer
    def take(self, step: int) -> Tuple[Sampled, Dict[str, float], Dict[str, float]]:
        """The ``prompts_per_step`` groups step ``step`` trains (the actor at version step - 1), the
        drawing thread's seconds since the last take, and the stream's metrics."""
        actor = step - 1
        groups: List[Group] = []
        stale = 0
        with self.changed:
            while len(groups) < self.per_step:
                group = self._next_group()
                if group is None:
                    self._wait(step)
                    continue
                if actor - group.oldest > self.bound:
                    # wait's admission rule and order keep every group within the bound
                    assert self.policy == StalenessPolicy.drop, (step, group.index, group.oldest)
                    self.counts["stale"] += 1
                    stale += 1
                    self._resolve(group)
                    continue
                self._resolve(group)
                groups.append(group)
            self.taken += len(groups)
            self.changed.notify_all()
            now = time.perf_counter()
            wall, self.since = now - self.since, now
            seconds = {f"time/{k}_s": v for k, v in self.busy.items()}
            metrics = {"sampling/stale_dropped_groups": stale,
                       "sampling/stale_dropped_frac": stale / (stale + len(groups)),
                       "sampling/in_flight_rows": self.rows_in_flight,
                       "sampling/queued_groups": sum(g is not None for g in self.finished.values()),
                       "sampling/rollout_idle_frac": min(self.idle_s / wall, 1.0) if wall > 0 else 0.0}
            self.busy, self.idle_s = dict.fromkeys(self.busy, 0.0), 0.0
            filtered, self.filtered_since = self.filtered_since, 0
            kept_frac = self.passed_since / self.scored_since if self.algo.filter_accuracy and self.scored_since else None
            self.scored_since = self.passed_since = 0
            rewards, self.reward_counts = self.reward_counts, {}
        responses = [dataclasses.replace(r, prompt_index=k) for k, g in enumerate(groups) for r in g.responses]
        sampled = Sampled([g.record for g in groups], [g.ids for g in groups], responses,
                          torch.cat([g.shaped for g in groups]), torch.cat([g.raw for g in groups]),
                          dropped_groups=filtered, kept_frac=kept_frac, reward_metrics=rewards)
        return sampled, seconds, metrics

    def _next_group(self) -> Optional[Group]:
        """The next group to train, if it is ready (``wait``: in admission order, filtered ones passed
        over; ``drop``: the first to finish)."""
        if self.policy == StalenessPolicy.wait:
            while self.next_index in self.finished:
                group = self.finished.pop(self.next_index)
                self.next_index += 1
                if group is not None:
                    return group
            return None
        while self.done_order:
            group = self.finished.pop(self.done_order.popleft())
            if group is not None:
                return group
        return None

    def _wait(self, step: int) -> None:
        """Wait for the drawing thread (its waits on the ranks carry the run's hang deadline); raise
        its error, or name the step if it ended without one."""
        self.changed.wait(timeout=READY_POLL_S)
        if self.failed is not None:
            raise self.failed
        if not self.thread.is_alive():
            raise RuntimeError(f"the rollout's drawing thread ended without the groups of step {step}")

    def resume_state(self) -> Dict:
        """The stream's state for this step's checkpoint: before the oldest group not yet trained
        (or now, if none), passing over the later prompts already trained, filtered or dropped."""
        with self.changed:
            if not self.live:
                return self.stream.state()
            oldest = self.live[min(self.live)]
            state = dict(oldest.state)
            state["skip"] = sorted(set(state["skip"]) | {p for p in self.resolved if p > oldest.position})
            return state


def train(cfg, roles, stream, scorer, log, eos_token_ids, pad_token_id: int, start_step: int = 1,
          after_step=None, agent=None, validator=None, kl=None) -> None:
    """The asynchronous loop of sample-level streaming (the module docstring); the training half
    is the synchronous loop's (:func:`train_on`)."""
    algo, data, t, r = cfg.algorithm, cfg.data, cfg.trainer, cfg.parallel.rollout
    assert agent is None, "trainer.loop=async runs single-turn samples (megarl.controller.split.check_streaming)"
    roles.rollout.update_weights(start_step - 1)
    if start_step == 1:
        validate(cfg, roles, validator, log, 0)
    bound = t.max_staleness  # 0: on policy, the synchronous loop's schedule (see _admission_seed)
    pool = SamplePool(roles.rollout, stream, scorer, algo, eos_token_ids, start_step, t.train_steps,
                      data.prompts_per_step, bound, t.staleness_policy,
                      r.max_inflight or data.prompts_per_step * algo.samples_per_prompt, r.partial_chunk_tokens,
                      r.partial_rollout, t.hang_timeout_s, t.seed)
    try:
        for step in range(start_step, t.train_steps + 1):
            with log.phase("wait_rollout"):  # what generation and scoring did not hide
                sampled, seconds, stream_metrics = pool.take(step)
            batch = make_batch(sampled, pad_token_id)
            batch, metrics = train_on(batch, roles, algo, log, step, kl, critic_only=step <= t.critic_warmup_steps)
            metrics = {**staleness_metrics(sampled, step - 1, bound), **stream_metrics, **seconds,
                       **sampling_metrics(sampled), **metrics}
            with log.phase("weight_sync"):
                metrics |= pool.sync(lambda: roles.rollout.update_weights(step), step)
            log.step(step, batch, metrics)
            validate(cfg, roles, validator, log, step, rollout=LockedRollout(pool))
            stream.mark(step, pool.resume_state())  # the checkpoint's stream: none lost, none twice
            if after_step:
                after_step(step)
            stream.forget(step)
    finally:
        pool.stop()
