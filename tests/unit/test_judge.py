"""The generative reward model's driver side (megarl.rewards.judge, the Scorer's routing): the
template's fields, the regex and function parsers, the counts of unparseable, too-long and
timed-out rows, and how judged and rule rows combine (alone, by data source, weighted sum). The
judge's engine is a stand-in that writes a fixed text per prompt; tests/e2e/test_judge.py runs the
real one through ``megarl train`` against transformers."""

from __future__ import annotations

import time

import pytest

from megarl.config import AlgorithmConfig
from megarl.config.schema import RewardModelConfig
from megarl.data.datasets import PromptRecord
from megarl.rewards import judge as judge_mod
from megarl.rewards.judge import JudgeScorer, check_template, compile_parser, is_function, parse_score, render
from megarl.rollout import Response
from megarl.trainer.steps import Scorer

FNS = "tests.unit.reward_fns"


class CharTokenizer:
    """Characters as token ids; the judge's prompt is its text, EOS is 0."""

    eos_token_ids = [0]

    def prompt_ids(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)

    encode = prompt_ids


class ScriptedJudge:
    """Writes ``answers(prompt_text)`` for each prompt; records its calls; ``delay`` seconds each."""

    def __init__(self, answers, delay: float = 0.0):
        self.answers, self.delay, self.calls = answers, delay, []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        time.sleep(self.delay)
        tok = CharTokenizer()
        return [Response(i, 0, tok.prompt_ids(self.answers(tok.decode(p))) + [0], [0.0], "stop")
                for i, p in enumerate(prompts)]


def scorer_for(rm: RewardModelConfig, positions: int = 4096) -> JudgeScorer:
    return JudgeScorer(rm, CharTokenizer(), positions)


def test_template_fields_are_checked_and_filled():
    check_template("Q: {question} R: {response} A: {reference}")
    with pytest.raises(ValueError, match=r"has the field\(s\) \['answer'\]"):
        check_template("{response} {answer}")
    with pytest.raises(ValueError, match="has no {response}"):
        check_template("{question}")
    with pytest.raises(ValueError, match="not a format string"):
        check_template("{response")
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert render("{question}|{response}|{reference}", chat, "4", None) == "be brief\n2+2?|4|"
    assert render("{question}|{response}|{reference}", "2+2?", "4", 4) == "2+2?|4|4"


def test_regex_parser_reads_the_first_match():
    pattern = compile_parser(RewardModelConfig().parser)
    assert parse_score(pattern, "fine. Score: 7.5 and Score: 2") == 7.5
    assert parse_score(pattern, "Score: -3") == -3.0
    assert parse_score(pattern, "no score here") is None
    assert parse_score(compile_parser(r"\d+"), "x 12 y") == 12.0  # no group: the whole match
    assert parse_score(compile_parser(r"(\w+)"), "nan") is None  # not finite
    assert parse_score(compile_parser(r"(\w+)"), "word") is None
    assert is_function("my_parser.py:parse") and is_function("pkg.mod:parse") and not is_function(r"Score:\s*(\d)")
    with pytest.raises(ValueError, match="neither module:function nor a regular expression"):
        compile_parser("(unclosed")


def test_judged_rows_batches_counts_and_texts():
    rm = RewardModelConfig(generative=True, template="{response}", parser=r"(\d)", batch_size=2, max_new_tokens=4)
    js = scorer_for(rm, positions=4 + 6)  # prompts over 6 characters are too long for the judge
    js.judge = ScriptedJudge(lambda text: {"a": "7 ok", "bb": "none", "ccc": "3"}.get(text, "9"))
    out = js.judge_rows(["q"] * 5, ["a", "bb", "ccc", "toolong", "dd"], [None] * 5)
    assert out.scores == [7.0, 0.0, 3.0, 0.0, 9.0]
    assert out.parsed == [True, False, True, False, True]
    assert out.texts[:3] == ["7 ok", "none", "3"] and out.texts[3] == ""
    assert out.counts == {"reward/judge_unparseable": 1, "reward/judge_timeouts": 0, "reward/judge_too_long": 1}
    assert js.judge.calls == [2, 2]  # 4 rows in batches of 2


def test_rows_past_the_deadline_are_counted_not_waited_for():
    rm = RewardModelConfig(generative=True, template="{response}", parser=r"(\d)", batch_size=1, timeout_s=0.2)
    js = scorer_for(rm)
    js.judge = ScriptedJudge(lambda text: "5", delay=0.15)
    out = js.judge_rows(["q"] * 4, ["a", "b", "c", "d"], [None] * 4)
    assert js.judge.calls == [1, 1]  # the third batch would start past 0.2 s
    assert out.scores == [5.0, 5.0, 0.0, 0.0]
    assert out.counts["reward/judge_timeouts"] == 2 and out.counts["reward/judge_unparseable"] == 0


def test_function_parser_runs_in_the_reward_workers(tmp_path):
    parser = tmp_path / "parse.py"
    parser.write_text("def parse(judgement, answer):\n"
                      "    if judgement == 'boom':\n        raise ValueError('cannot read')\n"
                      "    return None if judgement == 'none' else len(judgement) + float(answer)\n")
    algo = AlgorithmConfig(reward_workers=1)
    rm = RewardModelConfig(generative=True, template="{response}", parser=f"{parser}:parse")
    js = JudgeScorer(rm, CharTokenizer(), 4096, Scorer(algo, CharTokenizer())._pool)
    js.judge = ScriptedJudge(lambda text: text)
    try:
        out = js.judge_rows(["q"] * 3, ["abc", "boom", "none"], [1, 2, 3])
    finally:
        js.close()
    assert out.scores == [4.0, 0.0, 0.0] and out.parsed == [True, False, False]
    assert out.counts["reward/judge_unparseable"] == 2


@pytest.fixture
def judge_scorer(monkeypatch):
    """A Scorer whose judge reads ``Score: N`` from texts the stand-in writes: the response's length."""
    monkeypatch.setattr(judge_mod, "judge_tokenizer", lambda rm: CharTokenizer())
    monkeypatch.setattr(judge_mod, "judge_positions", lambda rm: 4096)

    def make(algo, **rm):
        scorer = Scorer(algo, CharTokenizer(), RewardModelConfig(generative=True, template="{response}", **rm))
        scorer.judge.judge = ScriptedJudge(lambda text: f"Score: {len(text)}" if text != "xx" else "no idea")
        return scorer

    return make


def sample(records, texts):
    tok = CharTokenizer()
    return [Response(i, 0, tok.prompt_ids(t), [0.0] * len(t), "stop") for i, t in enumerate(texts)], records


def test_scorer_judge_alone_by_source_and_weighted(judge_scorer):
    records = [PromptRecord("p", "7", "f:0", {"data_source": "chat"}),
               PromptRecord("p", "7", "f:1", {"data_source": "math"}),
               PromptRecord("p", "7", "f:2", {"data_source": "chat"})]
    responses, _ = sample(records, ["abc", "7", "xx"])
    alone = judge_scorer(AlgorithmConfig(reward_fn="model"))
    try:
        assert alone(records, responses).tolist() == [3.0, 1.0, 0.0]
        assert alone.last_judgements == ["Score: 3", "Score: 1", "no idea"]  # for the validation dump
        metrics = alone.take_metrics()
        assert metrics["reward/judge_unparseable"] == 1 and metrics["reward/judge_score_mean"] == 2.0
        assert alone.failures == 1
    finally:
        alone.close()
    by_source = judge_scorer(AlgorithmConfig(reward_fn="exact_match", reward_fn_by_source={"chat": "model"}))
    try:  # chat rows judged, math by exact_match ("7" == "7")
        assert by_source(records, responses).tolist() == [3.0, 1.0, 0.0]
        assert by_source.last_judgements == ["Score: 3", None, "no idea"]  # the math row: its rule's
        assert by_source.judge.judge.calls == [2]
    finally:
        by_source.close()
    summed = judge_scorer(AlgorithmConfig(reward_fn="exact_match"), rule_weight=0.5, judge_weight=2.0)
    try:  # every row: 0.5 x exact_match + 2 x judge
        assert summed(records, responses).tolist() == [6.0, 0.5 + 2.0, 0.0]
    finally:
        summed.close()


def test_validation_leaves_the_training_steps_judge_metrics(judge_scorer):
    """A validation's judgements (scored between steps, counters put back) do not reach the next
    step's reward/judge_* metrics."""
    records = [PromptRecord("p", "7", "f:0", {})]
    scorer = judge_scorer(AlgorithmConfig(reward_fn="model"))
    try:
        scorer(records, sample(records, ["abc"])[0])  # a training step's: Score 3
        saved = scorer.counters()
        scorer(records, sample(records, ["xx"])[0])  # a validation's: unparseable
        scorer(records, sample(records, ["abcdefg"])[0])  # Score 7
        scorer.restore(saved)
        metrics = scorer.take_metrics()
        assert metrics["reward/judge_score_mean"] == 3.0 and metrics["reward/judge_unparseable"] == 0
        assert scorer.failures == 0
    finally:
        scorer.close()


def test_scorer_refuses_model_sources_without_a_judge():
    with pytest.raises(ValueError, match=r"maps \['chat'\] to model: only a generative reward model"):
        Scorer(AlgorithmConfig(reward_fn="exact_match", reward_fn_by_source={"chat": "model"}), CharTokenizer())


def test_metrics_names_are_the_documented_ones():
    assert judge_mod.METRICS == ("reward/judge_unparseable", "reward/judge_timeouts", "reward/judge_too_long")
