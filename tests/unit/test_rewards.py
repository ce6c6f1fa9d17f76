"""Verifiers on tricky answers, reward functions by import path, datasets (the runner that calls
them safely: test_reward_runner.py)."""

import json

import pytest

from megarl.data.datasets import DataError, load_records
from megarl.data.tokenizer import DigitTokenizer
from megarl.rewards import resolve_reward_fn, reward_fn_path
from megarl.rewards.verifiers import boxed_answer, countdown_reward, gsm8k_reward, math_reward
from megarl.tasks.reverse_digits import reverse_digits_records, reverse_digits_reward

GSM8K = [  # (response, reference answer, verdict)
    ("She pays 3 * 4 = 12 dollars. #### 12", "12", 1.0),
    ("The total is $1,234.", "1234", 1.0),
    ("#### 1,234", "Natalia sold 48/2 = 24 clips.\n#### 1234", 1.0),
    ("It takes 7 apples", "7", 1.0),
    ("About 0.5 of them", "1/2", 1.0),
    ("The answer is 12.0", "12", 1.0),
    ("#### 13", "12", 0.0),
    ("I don't know", "12", 0.0),
    ("", "12", 0.0),
    ("5 then 7 then 12 then 13", "12", 0.0),  # the last number counts
    ("#### -3", "-3", 1.0),
    ("It is 45%", "45", 1.0),
]
# The math reward on MATH-style answer pairs (response's final answer, reference, verdict), by kind:
# math-verify's judgement (issue 43: the hand-written verifier judged 20 of 36 of such pairs right)
MATH = [
    # fractions and decimals
    ("so \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{3}}", "0.6", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    # roots
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{1}{2}\\sqrt{3}", 1.0),
    # pi
    ("\\boxed{\\pi/3}", "\\frac{\\pi}{3}", 1.0),
    ("\\boxed{2\\pi}", "\\pi", 0.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{1}{2}\\pi", 1.0),
    # intervals
    ("\\boxed{[0, 1)}", "[0,1)", 1.0),
    ("\\boxed{(0,1]}", "[0,1]", 0.0),
    ("\\boxed{(-\\infty, 2)}", "(-\\infty,2)", 1.0),
    # sets
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    # equations
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{y = 2x+1}", "2x+1", 1.0),
    ("\\boxed{x=4}", "5", 0.0),
    # expressions
    ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    # percentages
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{25\\%}", "50", 0.0),
    # units
    ("\\boxed{12 \\text{ cm}}", "12", 1.0),
    ("\\boxed{10\\text{ meters}}", "10", 1.0),
    ("\\boxed{9\\text{ cm}}", "10", 0.0),
    # multiple-choice letters
    ("\\boxed{\\text{(B)}}", "B", 1.0),
    ("\\boxed{(B)}", "B", 1.0),
    ("\\boxed{C}", "B", 0.0),
    # where the final answer is
    ("\\boxed{\\frac{1}{2}} and later \\boxed{2}", "2", 0.0),  # two boxes are one answer: the set {1/2, 2}
    ("the answer is \\boxed{2}", "2", 1.0),
    ("no box, the answer is 42", "42", 1.0),  # no box: the last expression
    ("I cannot tell", "42", 0.0),
    ("", "42", 0.0),
]
COUNTDOWN = [
    ("(3 + 5) * 2", {"target": 16, "numbers": [3, 5, 2]}, 1.0),
    ("3 * 5 + 2 = 17", {"target": 17, "numbers": [3, 5, 2]}, 1.0),
    ("3 * 3 + 7", {"target": 16, "numbers": [3, 5, 7]}, 0.0),  # 3 used twice
    ("__import__('os')", {"target": 0, "numbers": [1]}, 0.0),
    ("8 / (3 - 3)", {"target": 1, "numbers": [8, 3, 3]}, 0.0),
    ("", {"target": 1, "numbers": [1]}, 0.0),
]


@pytest.mark.parametrize("response,answer,verdict", GSM8K)
def test_gsm8k(response, answer, verdict):
    assert gsm8k_reward(response, answer) == verdict


@pytest.mark.parametrize("response,answer,verdict", MATH)
def test_math(response, answer, verdict):
    assert math_reward(response, answer) == verdict


@pytest.mark.parametrize("response,answer,verdict", COUNTDOWN)
def test_countdown(response, answer, verdict):
    assert countdown_reward(response, answer) == verdict


def test_boxed_nesting():
    assert boxed_answer("\\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"


@pytest.mark.parametrize("response,score", [("4321", 1.0), ("4320", 0.75), ("43", 0.5), ("432100", 4 / 6), ("", 0.0),
                                            ("1234", 0.0)])
def test_reverse_digits_partial_credit(response, score):
    assert reverse_digits_reward(response, "4321") == pytest.approx(score)


def test_reward_function_by_import_path():
    assert resolve_reward_fn("tests.unit.reward_fns:two_arguments")("ok", "ok") == 1.0
    assert resolve_reward_fn("gsm8k") is gsm8k_reward
    # what a worker process loads: a registered name becomes the function's import path
    assert reward_fn_path("gsm8k") == "megarl.rewards.verifiers:gsm8k_reward"
    assert reward_fn_path("tests.unit.reward_fns:sleepy") == "tests.unit.reward_fns:sleepy"
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward_fn("no.such.module:fn")
    with pytest.raises(KeyError):
        resolve_reward_fn("no-such-name")


def test_datasets_jsonl_parquet_and_bad_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n\n"
                    + json.dumps({"question": [{"role": "user", "content": "2+2?"}],
                                  "reward_model": {"ground_truth": "4"}}) + "\n")
    records = load_records([str(good)], prompt_key="question")
    assert [r.answer for r in records] == ["2", "4"] and records[1].source.endswith("good.jsonl:3")
    assert records[0].extra == {} and records[1].extra == {"reward_model": {"ground_truth": "4"}}
    pq.write_table(pa.Table.from_pylist([{"question": "3+3?", "answer": "6"}]), tmp_path / "p.parquet")
    assert load_records([str(tmp_path / "p.parquet")], prompt_key="question")[0].answer == "6"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "ok", "answer": 1}) + "\n{not json\n" + json.dumps({"q": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2 invalid JSON"):
        load_records([str(bad)], prompt_key="question")
    assert len(load_records([str(bad)], prompt_key="question", bad_rows="skip")) == 1
    with pytest.raises(DataError, match=r"bad.jsonl:1 has no 'prompt' field \(data.prompt_key\)"):
        load_records([str(bad)])
    with pytest.raises(DataError, match="does not exist"):
        load_records([str(tmp_path / "missing.jsonl")])


def test_builtin_task_and_tokenizer():
    tok = DigitTokenizer()
    record = reverse_digits_records(1, 4, seed=0)[0]
    ids = tok.prompt_ids(record.prompt)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == record.prompt
    assert record.answer == record.prompt[:4][::-1]
    with pytest.raises(ValueError, match="not in the built-in tokenizer"):
        tok.encode("abc")


VERL_FILE = '''
import helper  # the file's folder is on the import path: it imports its neighbours


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention, unchanged: a dict whose "score" is the reward."""
    return {"score": helper.weight(data_source) * float(solution_str.strip() == ground_truth) + extra_info["bonus"],
            "acc": 1.0}
'''


def test_reward_functions_from_files_and_verl_style_routed_by_data_source(tmp_path, monkeypatch):
    """algorithm.reward_fn=path/to/file.py:fn, relative to the directory the command runs in, loads
    in the worker processes by its absolute path (the workers start elsewhere); verl's
    compute_score(data_source, solution_str, ground_truth, extra_info) is called by its names and
    its dict's "score" taken; algorithm.reward_fn_by_source routes rows by data_source, the rest to
    reward_fn."""
    from megarl.config.schema import AlgorithmConfig
    from megarl.rewards import RewardPool, RewardSample
    from megarl.trainer.steps import reward_spec

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "verl_score.py").write_text(VERL_FILE)
    (tmp_path / "rewards" / "helper.py").write_text("def weight(source):\n    return 2.0 if source == 'b' else 1.0\n")
    monkeypatch.chdir(tmp_path)
    algo = AlgorithmConfig(reward_fn="exact_match",
                           reward_fn_by_source={"a": "rewards/verl_score.py:compute_score",
                                                "b": "rewards/verl_score.py:compute_score"})
    spec = reward_spec(algo)
    assert spec["by_source"]["a"] == f"{tmp_path / 'rewards' / 'verl_score.py'}:compute_score"
    monkeypatch.chdir("/")  # the workers' own directory is another
    samples = [RewardSample("42", "42", extra={"data_source": "a", "extra_info": {"bonus": 0.25}}),
               RewardSample("42", "42", extra={"data_source": "b", "extra_info": {"bonus": 0.0}}),
               RewardSample("41", "42", extra={"data_source": "a", "extra_info": {"bonus": 0.5}}),
               RewardSample("42", "42", extra={"data_source": "c"}),  # no route: exact_match
               RewardSample("42 ", "41", extra={})]
    pool = RewardPool(spec, 2, 10.0)
    try:
        report = pool.score(samples)
    finally:
        pool.close()
    assert report.scores == [1.25, 2.0, 0.5, 1.0, 0.0] and not report.failed, report
    with pytest.raises(ValueError, match="reward_fn_by_source.a: algorithm.reward_fn='nowhere.py:f': no such file"):
        reward_spec(AlgorithmConfig(reward_fn_by_source={"a": "nowhere.py:f"}))
    with pytest.raises(ValueError, match="reward_fn_by_source with algorithm.reward_fn=model"):
        from megarl.trainer.steps import Scorer

        Scorer(AlgorithmConfig(reward_fn="model", reward_fn_by_source={"a": "gsm8k"}), None)
