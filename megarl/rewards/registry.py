"""Reward functions by name, or a user's by import path (``package.module:function``) or file
(``path/to/my_reward.py:function``, relative to the directory the command runs in).

A reward function is ``fn(response_text: str, answer) -> float``; it may also take the record's
``prompt`` and ``extra`` (its other dataset fields) as keywords, or ``**kwargs``. verl's
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` works unchanged (known
by its parameter names; its ``dict`` result's ``"score"`` is the reward). It runs in the trainer's
reward worker processes, loaded there by import path or file: trusted code, with the trainer's
permissions. A registered function must therefore be a module-level one.
"""

from __future__ import annotations

from typing import Callable

import os

from megarl.registry import Registry, is_file_path, load_object
from megarl.rewards import verifiers
from megarl.tasks import reverse_digits

RewardFn = Callable[..., float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
REWARD_FUNCTIONS.register("reverse_digits")(reverse_digits.reverse_digits_reward)
REWARD_FUNCTIONS.register("gsm8k")(verifiers.gsm8k_reward)
REWARD_FUNCTIONS.register("math")(verifiers.math_reward)
REWARD_FUNCTIONS.register("countdown")(verifiers.countdown_reward)
REWARD_FUNCTIONS.register("exact_match")(verifiers.exact_match)


def resolve_reward_fn(name: str) -> RewardFn:
    """A registered name, ``module.path:function`` or ``path/to/file.py:function``."""
    if ":" not in name:
        return REWARD_FUNCTIONS.get(name)
    if is_file_path(name) and not os.path.isfile(name.rpartition(":")[0]):
        raise ValueError(f"algorithm.reward_fn='{name}': no such file {os.path.abspath(name.rpartition(':')[0])}")
    try:
        fn = load_object(name)
    except Exception as err:  # the module may fail in any way as it is imported (trusted, user code)
        raise ValueError(f"algorithm.reward_fn='{name}': cannot import ({type(err).__name__}: {err})") from None
    if not callable(fn):
        raise ValueError(f"algorithm.reward_fn='{name}' is not callable")
    return fn


def reward_fn_path(name: str) -> str:
    """The import path a worker process loads for ``algorithm.reward_fn=name`` (checked here,
    in the driver, so that a bad name fails before the run starts)."""
    try:
        fn = resolve_reward_fn(name)
    except KeyError as err:
        raise ValueError(f"algorithm.reward_fn: {err.args[0]}") from None
    if is_file_path(name):  # the workers may start elsewhere: the file by its absolute path
        file, _, attr = name.rpartition(":")
        return f"{os.path.abspath(file)}:{attr}"
    if ":" in name:
        return name
    path = f"{fn.__module__}:{fn.__qualname__}"
    try:
        found = load_object(path)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise ValueError(f"algorithm.reward_fn='{name}' is registered as {path}, which a worker process cannot "
                         f"import; register a module-level function")
    return path
