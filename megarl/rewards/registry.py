"""Reward functions by name, or a user's by import path (``package.module:function``).

A reward function is ``fn(response_text: str, answer) -> float``. A function given by import
path is trusted code: it runs inside the trainer's driver process with its permissions.
"""

from __future__ import annotations

import importlib
from typing import Callable

from megarl.algorithms.registry import Registry
from megarl.rewards import verifiers

RewardFn = Callable[[str, object], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
REWARD_FUNCTIONS.register("reverse_digits")(verifiers.reverse_digits_reward)
REWARD_FUNCTIONS.register("gsm8k")(verifiers.gsm8k_reward)
REWARD_FUNCTIONS.register("math")(verifiers.math_reward)
REWARD_FUNCTIONS.register("countdown")(verifiers.countdown_reward)
REWARD_FUNCTIONS.register("exact_match")(verifiers.exact_match)


def resolve_reward_fn(name: str) -> RewardFn:
    """A registered name, or ``module.path:function``."""
    if ":" not in name:
        return REWARD_FUNCTIONS.get(name)
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward.fn='{name}': cannot import ({err})") from None
    if not callable(fn):
        raise ValueError(f"reward.fn='{name}' is not callable")
    return fn
