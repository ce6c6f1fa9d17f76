"""Reward functions by name, or a user's by import path (``package.module:function``).

A reward function is ``fn(response_text: str, answer) -> float``; it may also take the record's
``prompt`` and ``extra`` (its other dataset fields) as keywords, or ``**kwargs``. It runs in the
trainer's reward worker processes, loaded there by import path: trusted code, with the trainer's
permissions. A registered function must therefore be a module-level one.
"""

from __future__ import annotations

from typing import Callable

from megarl.registry import Registry, load_object
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
    """A registered name, or ``module.path:function``."""
    if ":" not in name:
        return REWARD_FUNCTIONS.get(name)
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
