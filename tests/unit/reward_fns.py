"""Reward functions that the reward-runner tests load by import path in worker processes; kept
apart from the test module so that a worker imports nothing heavy."""

import os
import time


def sleepy(response, answer):
    """``hang``: sleeps for a minute (a hung function); ``fast``: 0.2 s, then 1."""
    time.sleep(60 if response == "hang" else 0.2)
    return 1.0


def misbehaving(response, answer):
    """A reward that is not a number, NaN/inf, raises or kills its process, by response."""
    if response == "raise":
        raise RuntimeError("bad sample")
    if response == "exit":
        os._exit(3)
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "str": "1.0", "none": None,
            "int": 2, "ok": 0.5}[response]


def crash_leaving_child(response, answer):
    """Starts a child in its worker's process group, writes the child's pid to the file named by
    ``response``, and kills its own process."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    with open(response, "w") as f:
        f.write(str(child.pid))
    os._exit(3)


def with_context(response, answer, prompt, extra):
    return float(len(prompt)) + extra["level"]


def keyword_prompt_only(response, answer, *, prompt):
    return float(len(prompt))


def any_keywords(response, answer, **kwargs):
    return float(sorted(kwargs) == ["extra", "prompt"])


def two_arguments(response, answer):
    return float(response == answer)


def by_digit(response, answer, extra):
    """The built-in tokenizer's responses are digits: 1 → NaN, 2 → a string, 3 → inf, else extra."""
    return {"1": float("nan"), "2": "2", "3": float("inf")}.get(response[:1], float(extra["level"]))


def memory_hungry(response, answer):
    """``big``: holds ``answer`` MB at once (past a worker's memory ceiling); else 1."""
    if response == "big":
        block = bytearray(int(answer) << 20)
        return float(len(block) > 0)
    return 1.0
