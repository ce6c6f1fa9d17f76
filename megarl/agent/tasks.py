"""The built-in multi-turn task: arithmetic with a calculator, in the digit tokenizer's vocabulary.

A prompt is ``a*b=`` (two n-digit operands). The policy's turn is either a calculator call, the
expression in parentheses (``(37*48)``), answered with the observation ``|1776|``, or its answer
(``1776``), which ends the episode with reward 1 when it equals the product, else 0. A product
of two 2-digit numbers is beyond a tiny model's own arithmetic, but copying the tool's result is
easy: RL should learn to call the tool. The warm start's demonstrations
(``megarl.training.tasks.calculator_batch``) use the same format, built by the helpers here.
"""

from __future__ import annotations

import re
import time
from typing import Optional

from megarl.agent.env import Environment, StepResult
from megarl.agent.tools import ToolError, calculator
from megarl.data.datasets import PromptRecord

_INTEGER = re.compile(r"-?[0-9]+")


def call_text(expression: str) -> str:
    """The policy's calculator call: the expression in parentheses."""
    return f"({expression})"


def observation_text(result: str) -> str:
    """The calculator's answer as the model reads it: between bars, which close the tool's message
    and leave the model to write its own turn (the digit tokenizer has no chat template).
    ``result`` "" (``||``): the call failed."""
    return f"|{result}|"


class CalculatorTask(Environment):
    """One episode of the calculator task; ``rollout.env=megarl.agent.tasks:CalculatorTask``.

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
