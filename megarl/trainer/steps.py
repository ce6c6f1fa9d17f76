"""Driver-side pieces of an RL step: prompts, sampling with rewards (DAPO dynamic sampling and
overlong shaping, ReMax's greedy baseline), the training batch, advantages."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, KL_ESTIMATORS, kl_penalty_rewards
from megarl.algorithms.advantages import prm_pair_accuracy
from megarl.algorithms.kl import AdaptiveKLController, FixedKLController
from megarl.agent.loop import Agent
from megarl.algorithms.presets import preset, resolve
from megarl.config import ConfigError
from megarl.config.schema import REWARD_MODEL, AggMode, BadRows, EpisodeReward, Truncation
from megarl.data.datasets import PromptRecord
from megarl.errors import NonFiniteOutput
from megarl.metrics import Metric, merge
from megarl.protocol import Batch, Columns
from megarl.rewards import RewardPool, RewardSample, reward_fn_path
from megarl.rollout import Response, SamplingParams

log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """A prompt over the stream's limit, with data.truncation=error or skip."""


class PromptStream:
    """Records in a seeded random order, epoch after epoch, tokenized once. A prompt longer than
    ``max_prompt_tokens`` is cut (``truncation`` left or right) or raises :class:`PromptTooLong`
    (error and skip: :func:`check_prompt_tokens` stops or drops the row); ``limit`` names the limit."""

    def __init__(self, records: Sequence[PromptRecord], tokenizer, seed: int, max_prompt_tokens: int,
                 truncation: Truncation = Truncation.error, limit: Optional[str] = None, shuffle: bool = True):
        self.records, self.tokenizer, self.shuffle = list(records), tokenizer, shuffle
        self.rng = random.Random(seed)
        self.order: List[int] = []
        self.ids = {}
        self.max_prompt_tokens, self.truncation = max_prompt_tokens, Truncation(truncation)
        self.limit = limit or f"the model's room of {max_prompt_tokens} (max positions - algorithm.max_new_tokens)"
        self.position = 0  # records handed out so far (a resumable data position)
        self.skip: set = set()  # positions to pass over (a resumed sample-streaming run's, already trained)
        self.lock = threading.Lock()
        self.marks: Dict[int, Dict] = {}  # step -> the state once its batch was drawn (draws ahead)

    def state(self) -> Dict:
        """Where the stream is now (for checkpoints of a loop that does not draw ahead)."""
        with self.lock:
            return self._state()

    def _state(self) -> Dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "position": self.position,
                "skip": sorted(self.skip)}

    def mark(self, step: int, state: Optional[Dict] = None) -> None:
        """Note where the stream is once step ``step``'s batch is drawn. A loop that draws ahead
        (one step off, streaming) has taken the records of later batches by the time step
        ``step`` is checkpointed: the checkpoint takes :meth:`state_after` ``(step)``, and a run
        resumed from it draws those batches again, from the same records (none lost, none twice).
        ``state``: the one to record instead (sample-level streaming computes it from its groups)."""
        with self.lock:
            self.marks[step] = self._state() if state is None else state

    def state_after(self, step: int) -> Dict:
        """The state once step ``step``'s batch was drawn (:meth:`mark`), else the state now."""
        with self.lock:
            return self.marks.get(step) or self._state()

    def forget(self, step: int) -> None:
        """Drop the marks of steps up to ``step`` (trained, and checkpointed if at all)."""
        with self.lock:
            for done in [k for k in self.marks if k <= step]:
                del self.marks[done]

    def load_state(self, state: Dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.position = list(state["order"]), state["position"]
        self.skip = set(state.get("skip", ()))

    def next(self, count: int) -> List[PromptRecord]:
        with self.lock:
            return self._next(count)

    def _next(self, count: int) -> List[PromptRecord]:
        out = []
        while len(out) < count:
            if not self.order:  # a new epoch; popped from the end
                self.order = list(range(len(self.records)))
                if self.shuffle:
                    self.rng.shuffle(self.order)
                else:
                    self.order.reverse()
            record, position = self.records[self.order.pop()], self.position
            self.position += 1
            if position in self.skip:
                self.skip.discard(position)
                continue
            out.append(record)
        return out

    def token_ids(self, record: PromptRecord) -> List[int]:
        key = id(record)
        if key not in self.ids:
            ids = self.tokenizer.prompt_ids(record.prompt)
            limit = self.max_prompt_tokens
            if len(ids) > limit:
                if self.truncation == Truncation.left:
                    ids = ids[-limit:]
                elif self.truncation == Truncation.right:
                    ids = ids[:limit]
                else:
                    raise PromptTooLong(f"{record.source}: prompt of {len(ids)} tokens exceeds {self.limit}")
            self.ids[key] = ids
        return self.ids[key]


def reward_spec(algo):
    """What a reward worker loads: the function's import path (or file), or with
    ``algorithm.reward_fn_by_source`` the default's and each data source's (checked here, in the
    driver, before the run starts). Sources mapped to ``model`` (the generative judge's) are left
    out, and so is a ``model`` default (None); None when no row is scored by a function."""
    default = None if algo.reward_fn == REWARD_MODEL else reward_fn_path(algo.reward_fn)
    rules = {s: name for s, name in algo.reward_fn_by_source.items() if name != REWARD_MODEL}
    if not rules:
        return default
    by_source = {}
    for source, name in rules.items():
        try:
            by_source[str(source)] = reward_fn_path(name)
        except ValueError as err:
            raise ValueError(f"algorithm.reward_fn_by_source.{source}: {err}") from None
    return {"default": default, "by_source": by_source}


class Scorer:
    """Decode responses and score them with the configured reward function in worker processes
    (:class:`RewardPool`, started on first use, kept for the run: call :meth:`close`), with the
    scalar reward-model role (``reward_fn=model``; set ``model`` to its proxy), or with a
    generative one (``reward_model.generative``; set ``judge.judge`` to its proxy), alone, by data
    source, or summed with the rule (:class:`megarl.rewards.judge.JudgeScorer`)."""

    def __init__(self, algo, tokenizer, reward_model=None):
        if algo.reward_timeout_s <= 0:
            raise ValueError(f"algorithm.reward_timeout_s={algo.reward_timeout_s} must be > 0")
        if algo.reward_workers < 1:
            raise ValueError(f"algorithm.reward_workers={algo.reward_workers} must be >= 1")
        self.model = None
        generative = reward_model is not None and reward_model.generative
        judged_sources = {str(s) for s, name in algo.reward_fn_by_source.items() if name == REWARD_MODEL}
        if not generative:
            if algo.reward_fn_by_source and algo.reward_fn == REWARD_MODEL:
                raise ValueError("algorithm.reward_fn_by_source with algorithm.reward_fn=model: the reward model scores "
                                 "every row; route by data_source between reward functions only (or set "
                                 "reward_model.generative=true: a judge takes some sources)")
            if judged_sources:
                raise ValueError(f"algorithm.reward_fn_by_source maps {sorted(judged_sources)} to model: only a "
                                 f"generative reward model (reward_model.generative=true) scores by data source")
        self.fn_path = reward_spec(algo) if generative or algo.reward_fn != REWARD_MODEL else None
        self.tokenizer, self.algo = tokenizer, algo
        self.judge = None
        self.last_judgements: List[Optional[str]] = []  # the judge's text per row of the last call, or None
        if generative:
            from megarl.rewards.judge import JudgeScorer

            self.judge = JudgeScorer.for_model(reward_model, self._pool)
            self.judged_sources, self.rm = judged_sources, reward_model
        self.pool: Optional[RewardPool] = None
        self.failures = 0  # failed and timed-out samples over the run (checkpointed)
        self.counts = {"reward/failures": 0, "reward/timeouts": 0}  # since the last take_metrics
        if self.judge is not None:
            from megarl.rewards.judge import METRICS

            self.counts |= dict.fromkeys(METRICS, 0)
            self.judged = [0.0, 0]  # sum and count of the parsed judge scores since the last take_metrics

    def attach(self, roles) -> None:
        """The run's reward-model roles (their proxies), once its workers have started."""
        self.model = roles.reward_model
        if self.judge is not None:
            self.judge.judge = roles.judge

    def _pool(self, fn_path) -> RewardPool:
        return RewardPool(fn_path, self.algo.reward_workers, self.algo.reward_timeout_s,
                          memory_mb=self.algo.reward_memory_mb)

    def _route(self, record) -> str:
        """``judge``, ``rule`` or ``both`` for a row (generative reward model)."""
        source = (record.extra or {}).get("data_source")
        if str(source) in self.judged_sources or (self.algo.reward_fn == REWARD_MODEL
                                                   and source not in self.algo.reward_fn_by_source):
            return "judge"
        return "rule" if self.rm.rule_weight is None else "both"

    def __call__(self, records: Sequence[PromptRecord], responses: Sequence[Response],
                 prompt_ids: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        if self.fn_path is None and self.judge is None:
            sampled = Sampled(list(records), list(prompt_ids), list(responses), torch.zeros(len(responses)),
                              torch.zeros(len(responses)))
            return self.model.compute_scores(make_batch(sampled, self.tokenizer.pad_token_id, -1))["scores"]
        samples = []
        for r in responses:
            record = records[r.prompt_index]
            samples.append(RewardSample(self.tokenizer.decode(r.token_ids), record.answer, record.prompt, record.extra))
        if self.judge is None:
            return torch.tensor(self._rules(samples))
        routes = [self._route(records[r.prompt_index]) for r in responses]
        ruled = [i for i, route in enumerate(routes) if route != "judge"]
        judged = [i for i, route in enumerate(routes) if route != "rule"]
        scores = [0.0] * len(samples)
        self.last_judgements = [None] * len(samples)
        for i, score in zip(ruled, self._rules([samples[i] for i in ruled]) if ruled else []):
            scores[i] = score * (1.0 if routes[i] == "rule" else self.rm.rule_weight)
        if judged:
            out = self.judge.judge_rows(*zip(*[(samples[i].prompt, samples[i].response, samples[i].answer,
                                                 samples[i].extra) for i in judged]))
            for k, v in out.counts.items():
                self.counts[k] += v
            self.failures += sum(out.counts.values())
            for i, score, parsed, text in zip(judged, out.scores, out.parsed, out.texts):
                scores[i] += self.rm.judge_weight * score
                self.last_judgements[i] = text
                self.judged[0] += score * parsed
                self.judged[1] += parsed
        return torch.tensor(scores)

    def _rules(self, samples: List[RewardSample]) -> List[float]:
        if self.pool is None:
            self.pool = self._pool(self.fn_path)
        report = self.pool.score(samples)
        self.counts["reward/failures"] += report.failed
        self.counts["reward/timeouts"] += report.timeouts
        self.failures += report.failed + report.timeouts
        return report.scores

    def counters(self) -> tuple:
        """What :meth:`take_metrics` and the run's failure count will report, to put back with
        :meth:`restore` after scoring that is not a training step's (validation)."""
        return dict(self.counts), self.failures, list(getattr(self, "judged", ()))

    def restore(self, saved: tuple) -> None:
        counts, self.failures, judged = saved
        self.counts = dict(counts)
        if self.judge is not None:
            self.judged = list(judged)

    def take_metrics(self) -> Dict[str, float]:
        """Failed and timed-out samples since the last call (one step's), for the step's metrics;
        with a judge also its unparseable, timed-out and too-long rows and its parsed scores' mean."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        if self.judge is not None:
            total, count = self.judged
            if count:
                out["reward/judge_score_mean"] = total / count
            self.judged = [0.0, 0]
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.judge is not None:
            self.judge.close()


def overlong_penalty(lengths: torch.Tensor, max_new: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_new - buffer, then
    linear down to -factor at max_new."""
    if buffer <= 0:
        return torch.zeros(lengths.shape)
    excess = (lengths.float() - (max_new - buffer)).clamp(min=0)
    return -factor * excess / buffer


def varied_groups(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[groups] bool: the group's scores are not all equal (DAPO dynamic sampling keeps these)."""
    ids = torch.unique(group)
    return torch.stack([scores[group == g].max() > scores[group == g].min() for g in ids])


def accurate_groups(raw: torch.Tensor, group: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """[groups] bool: the group's mean accuracy, its verifier rewards clamped to [0, 1], lies in
    [low, high] (PRIME's online filter keeps these first)."""
    accuracy = torch.stack([raw[group == g].clamp(0.0, 1.0).mean() for g in torch.unique(group)])
    return (accuracy >= low) & (accuracy <= high)


def kept_groups(algo, shaped: torch.Tensor, raw: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[groups] bool: the groups every filter the run has on keeps (DAPO's dynamic sampling on the
    shaped scores, PRIME's accuracy filter on the verifier's rewards); all of them with neither."""
    keep = torch.ones(len(torch.unique(group)), dtype=torch.bool)
    if algo.dynamic_sampling:
        keep &= varied_groups(shaped, group)
    if algo.filter_accuracy:
        keep &= accurate_groups(raw, group, algo.accuracy_lower_bound, algo.accuracy_upper_bound)
    return keep


@dataclass
class Sampled:
    """One step's prompts and responses with their scores."""

    records: List[PromptRecord]
    prompt_ids: List[List[int]]
    responses: List[Response]
    scores: torch.Tensor  # [rows], reward with shaping
    raw_scores: torch.Tensor  # [rows], the verifier's reward
    baseline: Optional[torch.Tensor] = None  # [rows], ReMax greedy reward
    rounds: int = 1
    dropped_groups: int = 0
    kept_frac: Optional[float] = None  # filter_accuracy: the share of the drawn groups the filters keep
    reward_metrics: Dict[str, float] = field(default_factory=dict)  # failed/timed-out samples (Scorer)
    agent_metrics: Dict[str, float] = field(default_factory=dict)  # multi-turn episodes (megarl.agent.loop)


def _untimed(name: str):
    return contextlib.nullcontext()


def sample_step(rollout, stream: PromptStream, scorer: Scorer, algo, prompts_per_step: int, seed: int,
                eos_token_ids: Sequence[int], phase=_untimed, agent: Optional[Agent] = None) -> Sampled:
    """Generate and score ``prompts_per_step`` groups (refilling dropped groups under dynamic
    sampling); a response ends at any of ``eos_token_ids``. ``phase(name)``: a context manager
    that times the ``generate`` and ``reward`` parts. With ``agent`` (``rollout.env`` set), each
    sample is a multi-turn episode (a turn ends at an EOS id) whose reward is its environment's
    (``rollout.reward=env``) or ``scorer``'s on the final turn (``verifier``)."""
    sampling = SamplingParams(temperature=algo.temperature, top_p=algo.top_p, top_k=algo.top_k,
                              n=algo.samples_per_prompt, max_new_tokens=algo.max_new_tokens,
                              stop_token_ids=list(eos_token_ids), seed=seed)
    kept: List[tuple] = []  # (record, ids, responses of the group, shaped scores, raw scores)
    spare: List[tuple] = []
    rounds = 0
    agent_metrics: List[Dict[str, Metric]] = []
    longest = algo.max_new_tokens if agent is None else agent.budget(algo.max_new_tokens)
    # PRIME's accuracy filter draws oversample_factor x the prompts still needed, in one round
    oversample = algo.oversample_factor if algo.filter_accuracy else 1.0
    while len(kept) < prompts_per_step and rounds < (algo.max_sampling_rounds if algo.dynamic_sampling else 1):
        records = stream.next(math.ceil((prompts_per_step - len(kept)) * oversample))
        ids = [stream.token_ids(r) for r in records]
        sampling.seed = seed * 1000 + rounds
        with phase("generate"):
            if agent is None:
                responses = rollout.generate(ids, sampling)
            else:
                episodes = agent.run(rollout, records, ids, sampling)
                responses = episodes.responses
                agent_metrics.append(episodes.metrics)
        with phase("reward"):
            if agent is None:
                raw = scorer(records, responses, ids)
            else:
                raw = episodes.rewards if agent.cfg.reward == EpisodeReward.env else scorer(records, episodes.final_turns, ids)
        lengths = torch.tensor([r.length for r in responses])
        shaped = raw + overlong_penalty(lengths, longest, algo.overlong_buffer, algo.overlong_penalty)
        group = torch.tensor([r.prompt_index for r in responses])
        keep = kept_groups(algo, shaped, raw, group)
        for g, record in enumerate(records):
            rows = (group == g).nonzero().flatten()
            entry = (record, ids[g], [responses[i] for i in rows], shaped[rows], raw[rows])
            (kept if keep[g] else spare).append(entry)
        rounds += 1
    drawn = len(kept) + len(spare)
    kept_frac = len(kept) / drawn if algo.filter_accuracy else None
    # kept groups first; past the round limit (or the oversampled draw) filtered ones fill the step
    kept = (kept + spare)[:prompts_per_step]
    dropped = drawn - len(kept)  # drawn and scored, not trained
    responses = []
    for g, (_, _, group_responses, _, _) in enumerate(kept):
        for r in group_responses:
            responses.append(dataclasses.replace(r, prompt_index=g))
    sampled = Sampled([k[0] for k in kept], [k[1] for k in kept], responses,
                      torch.cat([k[3] for k in kept]), torch.cat([k[4] for k in kept]), rounds=rounds,
                      dropped_groups=dropped, kept_frac=kept_frac)
    if preset(algo).greedy_baseline:  # the greedy response of each prompt is the baseline (ReMax)
        with phase("generate"):
            greedy = rollout.generate(sampled.prompt_ids, SamplingParams(
                temperature=0, max_new_tokens=algo.max_new_tokens, stop_token_ids=list(eos_token_ids)))
        with phase("reward"):
            base = scorer(sampled.records, greedy, sampled.prompt_ids)
        sampled.baseline = base[torch.tensor([r.prompt_index for r in responses])]
    sampled.reward_metrics = scorer.take_metrics()
    sampled.agent_metrics = merge(agent_metrics)
    return sampled


SEQ_MULTIPLE = 8  # batch widths divide by any tp <= 8 (sequence parallelism splits the sequence)


def make_batch(sampled: Sampled, pad_id: int, policy_version: Optional[int] = None) -> Batch:
    """Right-padded next-token batch: inputs ``tokens``, ``labels``, ``loss_mask`` on the
    positions that predict response tokens (the policy's only: an episode's observation tokens
    are context), ``rollout_log_probs`` there, and per-row fields
    (``policy_versions``: the rollout weights' version that generated each row; the batch's
    ``policy_version`` is ``policy_version``, default their oldest), the prompt and response ids
    as generated; with recorded MoE routing, ``routing`` [rows, seq, moe_layers, topk] (-1 past
    each row's tokens); from partial rollouts, ``token_versions``."""
    rows = sampled.responses
    prompts = [sampled.prompt_ids[r.prompt_index] if r.prompt_ids is None else r.prompt_ids for r in rows]
    seqs = [prompt + r.token_ids for prompt, r in zip(prompts, rows)]
    width = -(-(max(len(s) for s in seqs) - 1) // SEQ_MULTIPLE) * SEQ_MULTIPLE
    full = torch.full((len(rows), width + 1), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    rollout_logp = torch.zeros(len(rows), width)
    versions = torch.full((len(rows), width), -1, dtype=torch.long) if any(r.versions for r in rows) else None
    for i, (r, seq, prompt) in enumerate(zip(rows, seqs, prompts)):
        full[i, : len(seq)] = torch.tensor(seq)
        start = len(prompt) - 1
        # multi-turn: only the policy's tokens are trained, never an observation's
        loss_mask[i, start:start + r.length] = 1 if r.policy_mask is None else torch.tensor(r.policy_mask, dtype=torch.float)
        rollout_logp[i, start:start + r.length] = torch.tensor(r.log_probs)
        if versions is not None:
            versions[i, start:start + r.length] = torch.tensor(r.token_versions)
    routing = None
    if rows and all(r.routing is not None for r in rows):
        routing = torch.full((len(rows), width, *rows[0].routing.shape[1:]), -1, dtype=torch.int32)
        for i, (r, seq) in enumerate(zip(rows, seqs)):
            assert r.routing.shape[0] == len(seq) - 1, (r.routing.shape, len(seq))
            routing[i, : len(seq) - 1] = r.routing
    if policy_version is None:
        policy_version = min(r.policy_version for r in rows)
    return Batch(
        tokens=full[:, :-1].contiguous(), labels=full[:, 1:].contiguous(),
        position_ids=torch.arange(width).expand(len(rows), -1).contiguous(), loss_mask=loss_mask,
        rollout_log_probs=rollout_logp, lengths=torch.tensor([len(s) - 1 for s in seqs]),
        response_lengths=torch.tensor([r.length for r in rows]), scores=sampled.scores, raw_scores=sampled.raw_scores,
        index=torch.tensor([r.prompt_index for r in rows]),
        policy_versions=torch.tensor([r.policy_version for r in rows]),
        prompt_ids=[list(map(int, p)) for p in prompts], response_ids=[list(map(int, r.token_ids)) for r in rows],
        policy_version=policy_version, baseline_scores=sampled.baseline, routing=routing, token_versions=versions)


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows, seq]: each row's score on its last response position."""
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    return torch.where(last, scores.unsqueeze(-1), 0.0)


class KLCoefficient:
    """The coefficient of the KL in the reward: algorithm.kl_coef, or with algorithm.kl_target the
    adaptive controller's (Ziegler et al. 2019), updated after each step from the batch's KL and
    kept in checkpoints (``value``)."""

    def __init__(self, algo):
        self.algo = resolve(algo)
        a = self.algo
        self.controller = (AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_target is not None
                           else FixedKLController(a.kl_coef))

    @property
    def value(self) -> float:
        return self.controller.value

    @value.setter
    def value(self, coef: float) -> None:
        self.controller.value = coef

    def observe(self, batch: Batch) -> Dict[str, float]:
        """Update from ``batch`` (its mean over rows of each row's mean per-token KL to the
        reference, as verl measures it; one update per row); the coefficient applied and the KL."""
        mask = batch.loss_mask
        kl = KL_ESTIMATORS.get(self.algo.kl_estimator)(batch.old_log_probs, batch.ref_log_probs)
        per_row = torch.where(mask.bool(), kl, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
        current, applied = per_row.mean().item(), self.value
        self.controller.update(current, len(batch))
        return {"reward/kl_coef": applied, "reward/kl_mean": current}


def advantages(batch: Batch, algo, kl_coef: Optional[float] = None) -> Columns:
    """``advantages`` and ``returns`` ([rows, seq], zero off the response) for ``algo.name``'s preset.

    With the KL in the reward, each response token's reward is r_t - kl_coef * KL_t (the score on
    the last token); estimators of per-sequence scores read the sum of those rewards, and the
    per-row penalty kl_coef * sum_t KL_t comes back as ``kl_penalty``. ``kl_coef``: the adaptive
    controller's (:class:`KLCoefficient`); None = algorithm.kl_coef."""
    algo = resolve(algo)
    p = preset(algo)
    mask = batch.loss_mask
    rewards = last_token_rewards(batch.scores, mask)
    scores = batch.scores
    out: Dict[str, torch.Tensor] = {}
    coef = algo.kl_coef if kl_coef is None else kl_coef
    if algo.kl_coef and algo.kl_in_reward:
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(batch.old_log_probs, batch.ref_log_probs)
        rewards = kl_penalty_rewards(rewards, kl, coef, mask)
        out["kl_penalty"] = torch.where(mask.bool(), coef * kl, 0.0).sum(-1)
        scores = torch.where(mask.bool(), rewards, 0.0).sum(-1)
    inputs = AdvantageInputs(
        response_mask=mask, token_rewards=rewards, scores=scores,
        values=batch.values, index=batch.index, baseline_scores=batch.baseline_scores,
        gamma=algo.gamma, lam=algo.lam, lam_critic=algo.lam_critic, lam_length_alpha=algo.lam_length_alpha,
        process_rewards=batch.process_rewards, process_coef=algo.process_reward_coef,
        outcome_coef=algo.outcome_reward_coef, process_norm=algo.prm_norm, norm_by_std=algo.norm_by_std,
        whiten=p.whiten)
    out["advantages"], out["returns"] = ADVANTAGE_ESTIMATORS.get(p.estimator)(inputs)
    if batch.values is not None:
        out["old_values"] = batch.values
    if algo.positive_nll_coef:
        out["nll_weights"] = positive_nll_weights(batch.raw_scores, mask, algo.agg_mode)
    return Columns(out)


def positive_nll_weights(raw_scores: torch.Tensor, mask: torch.Tensor, agg_mode: AggMode) -> torch.Tensor:
    """[rows, seq]: each token's weight in VAPO's positive-example LM loss (Yue et al. 2025, eq. 9:
    the token-mean NLL over the samples whose verifier reward is > 0). The actor sums w * -log p
    and divides by the aggregation's count of the step (its tokens, or sequences with a seq-mean
    agg_mode), so w = count / positive tokens on positive rows' tokens, 0 elsewhere: over one
    mini-batch the term is exactly the token mean over the positive tokens."""
    positive = (raw_scores > 0)[:, None] & mask.bool()
    count = mask.sum() if agg_mode == AggMode.token_mean else (mask.sum(-1) > 0).sum()
    scale = count.to(torch.float64) / positive.sum().clamp(min=1)
    return torch.where(positive, scale, 0.0).to(mask.dtype)


def staleness_metrics(sampled: Sampled, actor_version: int, bound: int) -> Dict[str, float]:
    """How many versions the samples lag the actor that trains on them: ``sampling/staleness``
    (the largest, a row's oldest token), ``sampling/staleness_mean`` (over rows, by their oldest
    token), ``sampling/token_staleness_mean`` (over tokens: a partial rollout's tokens after a sync
    are newer), ``sampling/mixed_rows`` (the share of rows whose tokens span a weight sync) and
    ``sampling/token_lag_{k}`` for k = 0..bound (the share of tokens k versions old)."""
    rows = torch.tensor([actor_version - r.policy_version for r in sampled.responses])
    tokens = torch.tensor([actor_version - v for r in sampled.responses for v in r.token_versions], dtype=torch.long)
    out = {"sampling/staleness": rows.max().item(), "sampling/staleness_mean": rows.float().mean().item(),
           "sampling/mixed_rows": sum(len(set(r.token_versions)) > 1 for r in sampled.responses) / len(rows)}
    if len(tokens):
        out["sampling/token_staleness_mean"] = tokens.float().mean().item()
        out |= {f"sampling/token_lag_{k}": (tokens == k).float().mean().item() for k in range(bound + 1)}
    return out


def sampling_metrics(sampled: Sampled) -> Dict[str, float]:
    """What drawing the step's batch took: dynamic-sampling rounds, dropped groups, reward failures."""
    kept = {} if sampled.kept_frac is None else {"sampling/accuracy_kept_frac": sampled.kept_frac}
    return {"sampling/rounds": sampled.rounds, "sampling/dropped_groups": sampled.dropped_groups, **kept,
            **sampled.reward_metrics, **sampled.agent_metrics}


def check_finite(batch: Batch, column: str, what: str, step: Optional[int]) -> None:
    """Raise :class:`NonFiniteOutput` naming the step, the role's output and the rows where
    ``column`` is NaN or inf on a response token (a run whose weights or inputs went non-finite
    would otherwise fail later, in sampling or the update, without saying where it began)."""
    values = getattr(batch, column)
    if values is None:
        return
    bad = ~torch.isfinite(values) & batch.loss_mask.bool()
    if bad.any():
        rows = bad.any(-1).nonzero().flatten().tolist()
        at = f"step {step}: " if step is not None else ""
        raise NonFiniteOutput(f"{at}{what} hold NaN or inf on {int(bad.sum())} response token(s) of {len(rows)} "
                              f"row(s) (first rows {rows[:8]}): that model's weights or these inputs went "
                              f"non-finite; resume from an earlier checkpoint (lower optimizer.lr, check the data)")


def train_on(batch: Batch, roles, algo, log, step: Optional[int] = None,
             kl: Optional[KLCoefficient] = None, critic_only: bool = False) -> Tuple[Batch, Dict[str, float]]:
    """The training half of a step, the same under every schedule: old log-prob → reference
    log-prob → values (PRIME: PRM update → process rewards) → advantages → critic update → actor
    update. Returns the batch with the columns each phase added, and the updates' metrics. ``log.phase`` times each phase. A role's
    non-finite output stops the run there, named (:func:`check_finite`). ``kl``: the adaptive KL
    coefficient (algorithm.kl_target), applied, then updated from this batch. ``critic_only``: the
    value warm-up (trainer.critic_warmup_steps): the critic trains, the actor does not move."""
    check_finite(batch, "rollout_log_probs", "the rollout's log-probs of its samples", step)
    with log.phase("old_log_prob"):
        batch |= roles.actor.compute_log_prob(batch)
    check_finite(batch, "old_log_probs", "the actor's log-probs (old_log_probs)", step)
    if roles.reference:
        with log.phase("ref_log_prob"):
            batch |= roles.reference.compute_log_prob(batch)
        check_finite(batch, "ref_log_probs", "the reference's log-probs", step)
    if roles.critic:
        with log.phase("values"):
            batch |= roles.critic.compute_values(batch)
        check_finite(batch, "values", "the critic's values", step)
    metrics: Dict[str, float] = {}
    if roles.prm:  # PRIME: the implicit PRM learns from this batch's outcomes, then rewards its tokens
        batch |= Columns({"prm_labels": batch.raw_scores.clamp(0, 1)[:, None] * batch.loss_mask})
        with log.phase("prm_update"):
            metrics |= roles.prm.update(batch)
        with log.phase("process_rewards"):
            batch |= roles.prm.compute_rewards(batch)
        check_finite(batch, "process_rewards", "the implicit PRM's token rewards", step)
        z = torch.where(batch.loss_mask.bool(), batch.process_rewards, 0.0).sum(-1)
        pairs = prm_pair_accuracy(z, batch.raw_scores.clamp(0, 1), batch.index)
        metrics |= {} if pairs is None else {"prm/pair_acc": pairs}
    batch |= advantages(batch, algo, kl.value if kl else None)
    metrics |= kl.observe(batch) if kl else {}
    if roles.critic:
        with log.phase("critic_update"):
            metrics |= roles.critic.update(batch)
    if not critic_only:
        with log.phase("actor_update"):
            metrics |= roles.actor.update(batch)
    return batch, metrics


def check_prompt_tokens(stream: PromptStream, vocab_size: int, bad_rows: Optional[BadRows] = None) -> None:
    """Every prompt renders (chat template), fits the model's positions and uses only token ids the
    model has; so do the EOS and pad ids. A bad row fails here, naming its ``file:row``, before any
    worker starts, or with ``bad_rows="skip"`` (data.bad_rows; None: the built-in task's records,
    never skipped) is logged and dropped from the stream. The token ids stay cached for the run
    (10k short chat prompts through an HF chat template: about 0.9 s on one CPU core)."""
    kept, long = [], 0
    for record in stream.records:  # source: "file:row" or "task:index"
        try:
            problem = _prompt_problem(stream, record, vocab_size)
        except PromptTooLong as err:  # data.truncation=skip drops the row, and so does data.bad_rows=skip
            if stream.truncation != Truncation.skip and bad_rows != BadRows.skip:
                raise ConfigError(f"{err} (data.truncation=error; left or right cuts such prompts, skip drops "
                                  f"their rows)") from None
            log.warning("skipping %s", err)
            long += 1
            continue
        if problem is None:
            kept.append(record)
        elif bad_rows == BadRows.skip:
            log.warning("skipping %s: %s", record.source, problem)
        else:
            hint = " (set data.bad_rows=skip to skip such rows)" if bad_rows == BadRows.fail else ""
            raise ConfigError(f"{record.source}: {problem}{hint}")
    if long:
        log.warning("skipped %d of %d prompts over %s", long, len(stream.records), stream.limit)
    if len(kept) < len(stream.records):
        if len(kept) + long < len(stream.records):
            log.warning("skipped %d of %d prompts (data.bad_rows=skip)", len(stream.records) - len(kept) - long,
                        len(stream.records))
        if not kept:
            raise ConfigError("every prompt of the data files was skipped (data.bad_rows=skip, data.truncation="
                              "skip); see the log above")
        stream.records = kept
    tok = stream.tokenizer
    for name, ids in (("EOS", tok.eos_token_ids), ("pad", [tok.pad_token_id])):
        outside = [i for i in ids if not 0 <= i < vocab_size]
        if outside:
            raise ConfigError(f"the tokenizer's {name} id(s) {outside} are outside the model's vocabulary of "
                              f"{vocab_size} (data.tokenizer does not belong to the model)")


def _prompt_problem(stream: PromptStream, record, vocab_size: int) -> Optional[str]:
    """Why ``record``'s prompt cannot be used, or None."""
    import jinja2

    try:
        ids = stream.token_ids(record)
    except (jinja2.TemplateError, TypeError, KeyError) as err:
        return f"the prompt does not render with data.tokenizer's chat template: {err}"
    except PromptTooLong:
        raise
    except ValueError as err:  # characters it cannot encode
        return str(err).removeprefix(f"{record.source}: ")
    if not ids:
        return "the prompt has no tokens"
    if min(ids) < 0 or max(ids) >= vocab_size:
        outside = sorted({i for i in ids if not 0 <= i < vocab_size})
        return (f"the prompt has token id(s) {outside[:5]} outside the model's vocabulary of {vocab_size}; "
                f"data.tokenizer does not belong to the model")
    return None


def check_batch_split(data, algo, dp: int) -> None:
    """A step's rows (``data.prompts_per_step`` x ``algorithm.samples_per_prompt``) and PPO
    mini-batches against the actor's data parallelism."""
    rows = data.prompts_per_step * algo.samples_per_prompt
    if rows % dp:
        raise ConfigError(f"data.prompts_per_step={data.prompts_per_step} x algorithm.samples_per_prompt="
                          f"{algo.samples_per_prompt} = {rows} rows do not split over the actor's dp={dp}; "
                          f"make the product a multiple of {dp}")
    mini = algo.ppo_mini_batch_size
    if mini and (rows % mini or mini % dp):
        raise ConfigError(f"algorithm.ppo_mini_batch_size={mini} must divide the {rows} rows per step "
                          f"(data.prompts_per_step x algorithm.samples_per_prompt) and be a multiple of the "
                          f"actor's dp={dp}; null = the whole batch")
