"""The calculator task: its environment's scripted episodes, its prompt records, and the warm
start's demonstrations (format, loss mask) agreeing with what the environment answers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.data.datasets import DataError, PromptRecord
from megarl.data.tokenizer import DigitTokenizer
from megarl.tasks.calculator import CalculatorTask, calculator_batch, calculator_records, calculator_sequence_length
from megarl.tasks.registry import builtin_records
from megarl.tasks.reverse_digits import reverse_digits_records

TOKENS = DigitTokenizer()


def episode(answer, turns):
    """Run ``turns`` through a fresh environment; the StepResults."""
    async def run():
        env = CalculatorTask()
        assert await env.reset(PromptRecord("37*48=", answer, "calculator:0")) is None
        try:
            return [await env.step(turn) for turn in turns]
        finally:
            await env.close()
    return asyncio.run(run())


def test_call_then_answer():
    call, answer = episode("1776", ["(37*48)", "1776"])
    assert (call.observation, call.reward, call.done) == ("|1776|", 0.0, False)
    assert call.info["tool"] == "calculator" and not call.info.get("tool_error")
    assert 0.0 <= call.info["tool_seconds"] < 1.0
    assert (answer.observation, answer.reward, answer.done) == ("", 1.0, True)


def test_direct_answers_right_and_wrong():
    [right] = episode("1776", [" 1776 "])
    [wrong] = episode("1776", ["1777"])
    [longer] = episode("1776", ["17760"])
    assert (right.reward, right.done) == (1.0, True)
    assert (wrong.reward, wrong.done) == (0.0, True) and (longer.reward, longer.done) == (0.0, True)


@pytest.mark.parametrize("turn", ["(37*48", "(37**)", "()", "(1/0)", "(3/2)", "(9**9**9)"])
def test_bad_calls_are_error_observations_and_the_episode_goes_on(turn):
    # cut by the token limit, a syntax error, empty, the calculator's refusals (division by zero,
    # out of range) and a non-integer value (no "." in the digit vocabulary): all answered "||"
    bad, answer = episode("1776", [turn, "1776"])
    assert (bad.observation, bad.reward, bad.done) == ("||", 0.0, False)
    assert bad.info["tool_error"] is True
    assert (answer.reward, answer.done) == (1.0, True)


def test_calls_compute_other_expressions_and_negative_results():
    results = episode("0", ["(12-40)", "(7//2)", "(2*(3+4))", "0"])
    assert [r.observation for r in results[:3]] == ["|-28|", "|3|", "|14|"]
    assert not any(r.info.get("tool_error") for r in results)


def test_step_before_reset_is_refused():
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(CalculatorTask().step("1"))


def test_records_are_products_of_n_digit_operands():
    records = builtin_records("calculator", 200, 2, seed=3)
    assert records == calculator_records(200, 2, seed=3) and records != calculator_records(200, 2, seed=4)
    for i, record in enumerate(records):
        a, b = map(int, record.prompt.removesuffix("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and record.answer == str(a * b)
        assert record.source == f"calculator:{i}"
        TOKENS.encode(record.prompt)  # in the digit vocabulary
    assert builtin_records("reverse_digits", 3, 4, seed=3) == reverse_digits_records(3, 4, seed=3)
    with pytest.raises(DataError, match="data.task='sorting'"):
        builtin_records("sorting", 3, 4, seed=3)


def test_demonstrations_follow_the_environment_and_train_policy_tokens_only():
    batch = calculator_batch(step=5, batch_size=400, num_digits=2, seed=1, tool_call_rate=0.25)
    seq = calculator_sequence_length(2)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (400, seq) for k in batch}
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    calls = 0
    for tokens, labels, mask in zip(batch["tokens"].tolist(), batch["labels"].tolist(), batch["loss_mask"].tolist()):
        full = tokens[:1] + labels
        assert full[0] == TOKENS.bos_token_id
        text = "".join(TOKENS.vocab[i] for i in full if i != TOKENS.pad_token_id)
        prompt, rest = text.removeprefix("<bos>").split("=", 1)
        product = str(eval(prompt))  # two 2-digit operands: the reference value
        # the trained labels, in order: the policy's turns, each closed by EOS
        trained = "".join(TOKENS.vocab[label] for label, m in zip(labels, mask) if m)
        if rest.startswith("("):
            calls += 1
            turns = [f"({prompt})", product]
            assert rest == f"({prompt})<eos>|{product}|{product}<eos>"
            results = episode(product, turns)
            assert results[0].observation == f"|{product}|" and results[1].reward == 1.0
        else:
            assert rest == f"{product}<eos>"
        assert trained == "<eos>".join(turns if rest.startswith("(") else [product]) + "<eos>"
        # pads and prompt/observation tokens are never trained
        assert all(m == 0 for label, m in zip(labels, mask) if label == TOKENS.pad_token_id)
    assert 0.18 < calls / 400 < 0.32  # 0.25 ± 3.5 standard deviations of a binomial(400, 0.25) share
    assert torch.equal(calculator_batch(5, 400, 2, 1, 0.25)["tokens"], batch["tokens"])  # same on every rank


def test_train_lm_refuses_an_unknown_task_and_too_long_demonstrations():
    # what `megarl train-lm` checks before it launches torchrun (a ValueError: exit code 2)
    from megarl.config import load_config
    from megarl.entrypoints.train_lm import check_config

    def check(*overrides):
        check_config(load_config(["configs/agent/sft.yaml"], ["trainer.save_dir=null", *overrides]))

    check("data.num_digits=6")  # 57 tokens fit the tiny model's 64 positions
    with pytest.raises(ValueError, match="data.task='sorting'"):
        check("data.task=sorting")
    with pytest.raises(ValueError, match="data.num_digits=7: calculator demonstrations are 65 tokens, .*"
                                         "max_position_embeddings 64"):
        check("data.num_digits=7")


def test_the_rl_config_prepares_calculator_episodes():
    # configs/agent/calculator.yaml as megarl train checks it before any worker starts (a random
    # model in place of the warm start's directory): the built-in records are the calculator's, the
    # environment loads by import path, and a whole episode fits the model's positions
    from megarl.config import load_config
    from megarl.entrypoints.train_rl import prepare

    cfg = load_config(["configs/agent/calculator.yaml"],
                      ["model.path=null", "model.hf_config=configs/models/tiny-digits.json"])
    prepared = prepare(cfg)
    assert prepared.agent is not None and isinstance(prepared.agent.env_factory(), CalculatorTask)
    assert prepared.stream.records == calculator_records(cfg.data.builtin_size, 2, cfg.trainer.seed)
    # prompt "BOS 37*48=" (7) + call with EOS (8) + observation (6) + answer with EOS (5) = 26 <= 7 + 32
    assert prepared.agent.budget(cfg.algorithm.max_new_tokens) == 32
