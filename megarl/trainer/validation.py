"""Held-out evaluation: the current policy on ``data.val_files`` through the run's rollout backend.

Every validation prompt gets ``algorithm.val_samples_per_prompt`` (n) responses at
``algorithm.val_temperature`` (0 = greedy) and ``algorithm.val_max_new_tokens``, scored by the
run's reward functions. Metrics, overall and per ``data_source`` (``val/<source>/...``):

- ``val/reward/mean@n``: the mean reward of every response;
- ``val/pass@1`` and ``val/pass@n``: the unbiased pass@k of Chen et al. 2021 (1 - C(n-c, k) / C(n, k)
  per prompt, c of its n responses correct: a reward >= 1), averaged over prompts;
- ``val/maj@n``: the reward of the majority answer of each prompt's n responses, where the reward
  function can extract an answer (:data:`EXTRACTORS`);
- ``val/response/length_mean``: response tokens.

The draws have their own seed (:func:`validation_seed`), the same at every validation and in
``megarl eval``: a sample's stream depends only on (seed, prompt, sample), so validating changes no
training draw, and the same weights give the same responses. The reward workers' failure counts
of the training steps are left as they were.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megarl.rewards import verifiers
from megarl.rollout import SamplingParams
from megarl.tasks import reverse_digits

CORRECT = 1.0  # a response is correct (pass@k) when its reward reaches this
CHUNK = 256  # prompts per generate call

# reward function name -> the answer a response gives (None: none), for maj@n
EXTRACTORS: Dict[str, Callable[[str], Optional[str]]] = {
    "gsm8k": verifiers.gsm8k_answer,
    "math": verifiers.boxed_answer,
    "reverse_digits": lambda response: response.strip() or None,
    "exact_match": lambda response: response.strip() or None,
}
assert reverse_digits  # the built-in task's reward compares the whole response, as exact_match


HEADLINE = re.compile(r"^val/(reward/mean@\d+|pass@\d+|maj@\d+)$")  # the overall scores (console, report)


def validation_seed(trainer_seed: int) -> int:
    """The validation draws' seed: apart from the training steps' ((trainer.seed + step) * 1000 + round)."""
    return (1 << 40) + trainer_seed


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased estimate of pass@k from n samples, c of them correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class Sample:
    prompt_index: int
    source: str
    reward: float
    length: int
    response: str
    answer: Optional[str]  # what the response answers (EXTRACTORS), None where none is known


def summarize(samples: Sequence[Sample], n: int, majority: bool) -> Dict[str, float]:
    """The metrics of the module docstring over ``samples`` (n per prompt), overall and per source."""
    out: Dict[str, float] = {}
    by_source: Dict[str, List[Sample]] = collections.defaultdict(list)
    for s in samples:
        by_source[s.source].append(s)
    groups = [("val/", list(samples))]
    if len(by_source) > 1 or (by_source and next(iter(by_source)) != ""):
        groups += [(f"val/{source}/", rows) for source, rows in sorted(by_source.items()) if source]
    for prefix, rows in groups:
        prompts: Dict[int, List[Sample]] = collections.defaultdict(list)
        for s in rows:
            prompts[s.prompt_index].append(s)
        out[f"{prefix}reward/mean@{n}"] = sum(s.reward for s in rows) / len(rows)
        out[f"{prefix}response/length_mean"] = sum(s.length for s in rows) / len(rows)
        out[f"{prefix}prompts"] = float(len(prompts))
        for k in sorted({1, n}):
            out[f"{prefix}pass@{k}"] = sum(pass_at_k(len(g), sum(s.reward >= CORRECT for s in g), k)
                                           for g in prompts.values()) / len(prompts)
        if majority:
            out[f"{prefix}maj@{n}"] = sum(majority_reward(g) for g in prompts.values()) / len(prompts)
    return out


def majority_reward(group: Sequence[Sample]) -> float:
    """The reward of the most frequent answer among a prompt's responses (ties: the answer seen
    first); no answer extracted from any: 0."""
    answers = [s.answer for s in group if s.answer is not None]
    if not answers:
        return 0.0
    counts = collections.Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return next(s.reward for s in group if s.answer == winner)


class Validator:
    """Evaluates the rollout's current weights on the validation prompts (a :class:`PromptStream`
    whose records were checked as the training prompts are)."""

    def __init__(self, val_stream, scorer, algo, eos_token_ids: Sequence[int], seed: int, decode):
        self.stream, self.scorer, self.algo, self.decode = val_stream, scorer, algo, decode
        self.n = algo.val_samples_per_prompt
        self.sampling = SamplingParams(temperature=algo.val_temperature, n=self.n,
                                       max_new_tokens=algo.val_max_new_tokens or algo.max_new_tokens,
                                       stop_token_ids=list(eos_token_ids), seed=validation_seed(seed))
        self.extract = EXTRACTORS.get(algo.reward_fn) if not algo.reward_fn_by_source else None

    def run(self, rollout) -> Tuple[Dict[str, float], List[Dict]]:
        """(metrics, one dump row per response)."""
        records = self.stream.records
        samples: List[Sample] = []
        rows: List[Dict] = []
        saved = self.scorer.counters()  # the training steps' own
        try:
            for start in range(0, len(records), CHUNK):
                chunk = records[start:start + CHUNK]
                ids = [self.stream.token_ids(r) for r in chunk]
                responses = rollout.generate(ids, self.sampling)
                rewards = self.scorer(chunk, responses, ids)
                judgements = getattr(self.scorer, "last_judgements", None) if getattr(self.scorer, "judge", None) else None
                for k, (r, reward) in enumerate(zip(responses, rewards.tolist())):
                    record = chunk[r.prompt_index]
                    text = self.decode(r.token_ids)
                    source = str((record.extra or {}).get("data_source", ""))
                    answer = self.extract(text) if self.extract else None
                    samples.append(Sample(start + r.prompt_index, source, reward, len(r.token_ids), text, answer))
                    rows.append({"prompt_index": start + r.prompt_index, "sample_index": r.sample_index,
                                 "source": record.source, "data_source": source,
                                 "prompt": self.decode(ids[r.prompt_index]), "response": text,
                                 "response_ids": list(r.token_ids), "reward": reward,
                                 "answer": record.answer if isinstance(record.answer, (str, int, float)) else None,
                                 "extracted": answer, "finish_reason": r.finish_reason,
                                 **({"judgement": judgements[k]} if judgements else {})})
        finally:
            self.scorer.restore(saved)
        return summarize(samples, self.n, self.extract is not None), rows
