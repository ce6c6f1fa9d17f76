"""The built-in tasks by ``data.task`` name (their prompts), for runs without ``data.train_files``."""

from __future__ import annotations

from typing import Callable, List

from megarl.data.datasets import DataError, PromptRecord
from megarl.registry import Registry
from megarl.tasks import calculator, reverse_digits

RecordsFn = Callable[[int, int, int], List[PromptRecord]]  # (count, num_digits, seed) -> prompts
TASKS: Registry[RecordsFn] = Registry("built-in task")
"""The prompts of each built-in task by ``data.task`` name."""
TASKS.register("reverse_digits")(reverse_digits.reverse_digits_records)
TASKS.register("calculator")(calculator.calculator_records)


def builtin_records(task: str, count: int, num_digits: int, seed: int) -> List[PromptRecord]:
    """The prompts of the built-in task ``data.task`` (used when data.train_files is empty)."""
    if task not in TASKS.names():
        raise DataError(f"data.task='{task}' must be one of {TASKS.names()}")
    return TASKS.get(task)(count, num_digits, seed)
