"""The built-in multi-turn task: arithmetic with a calculator, in the digit tokenizer's vocabulary.

A prompt is ``a*b=`` (two n-digit operands). The policy's turn is either a calculator call, the
expression in parentheses (``(37*48)``), answered with the observation ``|1776|``, or its answer
(``1776``), which ends the episode with reward 1 when it equals the product, else 0. A product
of two 2-digit numbers is beyond a tiny model's own arithmetic, but copying the tool's result is
easy: RL should learn to call the tool. Its RL prompts (:func:`calculator_records`), the warm
start's demonstrations (:func:`calculator_batch`) and the environment (:class:`CalculatorTask`,
``rollout.env=megarl.tasks.calculator:CalculatorTask``) share the format built by the helpers here.
"""

from __future__ import annotations

import random
import re
import time
from typing import Dict, List, Optional, Tuple

import torch

from megarl.agent.env import Environment, StepResult
from megarl.agent.tools import ToolError, calculator
from megarl.data.datasets import PromptRecord
from megarl.data.tokenizer import DigitTokenizer

_INTEGER = re.compile(r"-?[0-9]+")
_DIGITS = DigitTokenizer()
BOS, EOS = _DIGITS.bos_token_id, _DIGITS.eos_token_id


def call_text(expression: str) -> str:
    """The policy's calculator call: the expression in parentheses."""
    return f"({expression})"


def observation_text(result: str) -> str:
    """The calculator's answer as the model reads it: between bars, which close the tool's message
    and leave the model to write its own turn (the digit tokenizer has no chat template).
    ``result`` "" (``||``): the call failed."""
    return f"|{result}|"


class CalculatorTask(Environment):
    """One episode of the calculator task; ``rollout.env=megarl.tasks.calculator:CalculatorTask``.

    A turn that starts with ``(`` is a call: the text inside the outer parentheses goes to the
    calculator and its value comes back as ``|value|``; a malformed call (no closing parenthesis,
    as when the turn's token limit cut it), an expression the calculator refuses or a value that is
    not an integer (the digit vocabulary has no "." nor "e") comes back as ``||`` with
    ``info["tool_error"]=True``, and the episode goes on. Any other turn is the answer.
    """

    # The digit tokenizer has no chat template to render tool definitions: the call format is
    # the warm start's, so the prompt names no tools.
    tools = []

    def __init__(self):
        self.answer: Optional[str] = None

    async def reset(self, record: PromptRecord) -> Optional[str]:
        self.answer = str(record.answer).strip()
        return None

    async def step(self, message: str) -> StepResult:
        if self.answer is None:
            raise RuntimeError("CalculatorTask.step before reset: the episode has no record")
        text = message.strip()
        if not text.startswith("("):
            return StepResult(reward=float(text == self.answer), done=True, info={"answer": text})
        info = {"tool": "calculator"}
        if not text.endswith(")"):
            info.update(tool_error=True, tool_seconds=0.0)
            return StepResult(observation_text(""), info=info)
        start = time.perf_counter()
        try:
            # inline, not in a thread: the calculator's limits (256 characters, |value| <= 1e100)
            # bound its work to well under a millisecond, less than a thread hand-off costs
            value = calculator(text[1:-1])
        except ToolError:  # the calculator's refusal of a bad or too costly expression
            value = ""
        info["tool_seconds"] = time.perf_counter() - start
        if not _INTEGER.fullmatch(value):  # a refusal, or "1.5" / "1e+20": not in the digit vocabulary
            info["tool_error"] = True
            value = ""
        return StepResult(observation_text(value), info=info)


def calculator_records(count: int, num_digits: int, seed: int) -> List[PromptRecord]:
    """The built-in multi-turn task (:class:`CalculatorTask`): "37*48=" → answer "1776",
    two operands of ``num_digits`` digits (no leading zero)."""
    rng = random.Random(seed)
    low, high = 10 ** (num_digits - 1), 10 ** num_digits - 1
    out = []
    for i in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        out.append(PromptRecord(f"{a}*{b}=", str(a * b), f"calculator:{i}"))
    return out


def calculator_sequence_length(num_digits: int) -> int:
    """Input tokens of a calculator demonstration that calls the tool (the longest kind)."""
    # BOS a*b= (2n+3), (a*b) EOS (2n+4), |product| (2n+2), product EOS (2n+1); minus the last label
    return 8 * num_digits + 9


def calculator_batch(step: int, batch_size: int, num_digits: int, seed: int,
                     tool_call_rate: float) -> Dict[str, torch.Tensor]:
    """Demonstrations of the calculator task (:class:`CalculatorTask`), as the agent
    loop's transcripts: ``BOS a*b=`` then, with probability ``tool_call_rate``, the call
    ``(a*b) EOS``, the tool's observation ``|product|`` and the answer ``product EOS``; otherwise
    the answer ``product EOS`` at once. The loss covers the policy's tokens only (not the prompt,
    not the observation); rows are right-padded with <pad> under loss_mask 0.

    Returns next-token tensors [batch, 8n+9]: tokens, labels, loss_mask, position_ids; the same
    (step, seed) gives the same batch on every rank.
    """
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    operands = torch.randint(10 ** (num_digits - 1), 10 ** num_digits, (batch_size, 2), generator=gen)
    calls = torch.rand(batch_size, generator=gen) < tool_call_rate
    full_length = calculator_sequence_length(num_digits) + 1
    full = torch.full((batch_size, full_length), _DIGITS.pad_token_id)
    policy = torch.zeros(batch_size, full_length)  # 1 where the token is the policy's (its label is trained)
    for row, ((a, b), call) in enumerate(zip(operands.tolist(), calls.tolist())):
        expression, product = f"{a}*{b}", str(a * b)
        segments: List[Tuple[List[int], bool]] = [([BOS] + _DIGITS.encode(expression + "="), False)]
        if call:
            segments += [(_DIGITS.encode(call_text(expression)) + [EOS], True),
                         (_DIGITS.encode(observation_text(product)), False)]
        segments.append((_DIGITS.encode(product) + [EOS], True))
        at = 0
        for ids, is_policy in segments:
            full[row, at:at + len(ids)] = torch.tensor(ids)
            policy[row, at:at + len(ids)] = float(is_policy)
            at += len(ids)
    seq = full_length - 1
    return {"tokens": full[:, :-1].contiguous(), "labels": full[:, 1:].contiguous(),
            "loss_mask": policy[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).expand(batch_size, -1).contiguous()}
