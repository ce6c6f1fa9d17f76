"""A generative reward model (an LLM judge, ``reward_model.generative``), the driver's side: each
sample filled into ``reward_model.template``, tokenized by the judge's own tokenizer, judged by
the judge role (megarl.roles.judge: a rollout backend's engine on the training ranks) in batches
within ``reward_model.timeout_s``, and the judgement's text read by ``reward_model.parser``.

A judgement that yields no score (no match, not a number, the parser function failing) scores 0
and is counted, as are prompts too long for the judge and rows past the deadline: the run goes on.
"""

from __future__ import annotations

import math
import re
import string
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from megarl.registry import is_file_path

FIELDS = ("question", "response", "reference")
METRICS = ("reward/judge_unparseable", "reward/judge_timeouts", "reward/judge_too_long")


def check_template(template: str) -> None:
    """Its fields are among :data:`FIELDS`, ``{response}`` among them (ValueError naming the rest)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"reward_model.template is not a format string: {err} (write literal braces as {{{{ }}}})")
    unknown = sorted(names - set(FIELDS))
    if unknown:
        raise ValueError(f"reward_model.template has the field(s) {unknown}; it may use {list(FIELDS)}")
    if "response" not in names:
        raise ValueError("reward_model.template has no {response}: the judge would not see what it grades")


def question_text(prompt: Any) -> str:
    """A record's prompt as text: a string as it is, chat messages' contents joined by newlines."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)


def render(template: str, prompt: Any, response: str, answer: Any) -> str:
    return template.format(question=question_text(prompt), response=response,
                           reference="" if answer is None else str(answer))


def is_function(parser: str) -> bool:
    """A parser given as ``module:function`` or ``file.py:function`` rather than a regex."""
    return is_file_path(parser) or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", parser) is not None


def compile_parser(parser: str) -> "re.Pattern":
    try:
        pattern = re.compile(parser)
    except re.error as err:
        raise ValueError(f"reward_model.parser={parser!r} is neither module:function nor a regular expression: {err}")
    return pattern


def parse_score(pattern: "re.Pattern", text: str) -> Optional[float]:
    """The number at the pattern's first match (its first group, or the whole match), None when
    there is no match or it is not a finite number."""
    match = pattern.search(text)
    if match is None:
        return None
    try:
        value = float(match.group(1) if pattern.groups else match.group(0))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@dataclass
class Judgements:
    scores: List[float]  # per row, 0 where it yields none
    parsed: List[bool]
    texts: List[str]
    counts: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(METRICS, 0))


def judge_hf_config(rm) -> str:
    """The judge's config.json: ``reward_model.hf_config``, else ``reward_model.path``'s."""
    from pathlib import Path

    return rm.hf_config or str(Path(rm.path) / "config.json")


def judge_tokenizer(rm):
    """The judge's own tokenizer (``reward_model.path``), with its chat template when
    ``reward_model.chat_template``."""
    from megarl.data.tokenizer import HFTokenizer

    return HFTokenizer(rm.path, chat_template=rm.chat_template)


def judge_positions(rm) -> int:
    from megarl.models.hf_config import megatron_args_from_hf

    return megatron_args_from_hf(judge_hf_config(rm)).max_position_embeddings


class JudgeScorer:
    """Scores rows with the judge role (``judge``: its proxy, set after the workers start).
    ``tokenizer``: the judge's (megarl.data.tokenizer.HFTokenizer); ``positions``: its model's
    positions; ``pool``: a callable starting the reward worker pool for a function parser."""

    def __init__(self, rm, tokenizer, positions: int, pool: Optional[Callable[[str], Any]] = None):
        check_template(rm.template)
        self.rm, self.tokenizer, self.positions = rm, tokenizer, positions
        self.pattern = None if is_function(rm.parser) else compile_parser(rm.parser)
        self.pool_factory, self.pool = pool, None
        self.judge = None
        self.calls = 0

    @classmethod
    def for_model(cls, rm, pool: Optional[Callable[[str], Any]] = None) -> "JudgeScorer":
        """The scorer of ``reward_model``'s judge, with its own tokenizer and positions."""
        return cls(rm, judge_tokenizer(rm), judge_positions(rm), pool)

    def judge_rows(self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any],
                   extras: Sequence[Dict[str, Any]] = ()) -> Judgements:
        from megarl.rollout.types import SamplingParams

        rm, n = self.rm, len(responses)
        out = Judgements([0.0] * n, [False] * n, [""] * n)
        ids, rows = [], []
        for i, (prompt, response, answer) in enumerate(zip(prompts, responses, answers)):
            tokens = self.tokenizer.prompt_ids(render(rm.template, prompt, response, answer))
            if len(tokens) + rm.max_new_tokens > self.positions:
                out.counts["reward/judge_too_long"] += 1
                continue
            ids.append(tokens)
            rows.append(i)
        sampling = SamplingParams(temperature=rm.temperature, max_new_tokens=rm.max_new_tokens,
                                  stop_token_ids=list(self.tokenizer.eos_token_ids), seed=self.calls)
        self.calls += 1
        deadline = time.monotonic() + rm.timeout_s
        done: List[int] = []  # the rows judged, in order
        for start in range(0, len(ids), rm.batch_size):
            if time.monotonic() >= deadline:
                out.counts["reward/judge_timeouts"] += len(ids) - start
                break
            batch = rows[start:start + rm.batch_size]
            for r in self.judge.generate(ids[start:start + rm.batch_size], sampling):
                out.texts[batch[r.prompt_index]] = self.tokenizer.decode(r.token_ids)
            done += batch
        scores = self._parse([out.texts[i] for i in done], [answers[i] for i in done],
                             [prompts[i] for i in done], [extras[i] if extras else {} for i in done])
        for i, score in zip(done, scores):
            if score is None:
                out.counts["reward/judge_unparseable"] += 1
            else:
                out.scores[i], out.parsed[i] = score, True
        return out

    def _parse(self, texts: List[str], answers, prompts, extras) -> List[Optional[float]]:
        if self.pattern is not None:
            return [parse_score(self.pattern, t) for t in texts]
        from megarl.rewards.runner import RewardSample

        if self.pool is None:
            self.pool = self.pool_factory(self.rm.parser)
        report = self.pool.score([RewardSample(t, a, p, e) for t, a, p, e in zip(texts, answers, prompts, extras)])
        return [None if i in report.failed_rows else s for i, s in enumerate(report.scores)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
