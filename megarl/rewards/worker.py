"""A reward worker process (started by :class:`megarl.rewards.runner.RewardPool`): loads one
reward function by import path, then scores the samples that the pool sends it.

Frames on stdin/stdout are length-prefixed pickles; the user function's own prints go to stderr.
This module and the package it lives in import no torch, so a worker starts in tens of ms.
"""

from __future__ import annotations

import inspect
import math
import os
import pickle
import struct
import time
from typing import Any, Optional, Tuple

from megarl.registry import load_object

KEYWORDS = ("prompt", "extra")  # what a reward function may take beyond (response, answer)
# verl's compute_score(data_source, solution_str, ground_truth, extra_info): known by these names
VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
_HEADER = struct.Struct("!I")


def is_verl_style(fn) -> bool:
    """Whether ``fn`` takes verl's ``solution_str`` and ``ground_truth`` (by name)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return {"solution_str", "ground_truth"} <= names


def caller(fn):
    """``call(response, answer, context) -> value``: ``fn`` called in its own convention: verl's
    keywords (``data_source`` and ``extra_info`` from the record's fields), or megarl's
    ``(response, answer)`` with the keywords it accepts."""
    if is_verl_style(fn):
        names = set(inspect.signature(fn).parameters)

        def verl(response, answer, context):
            extra = context["extra"] or {}
            given = {"data_source": extra.get("data_source"), "solution_str": response, "ground_truth": answer,
                     "extra_info": extra.get("extra_info", extra)}
            return fn(**{k: v for k, v in given.items() if k in names})

        return verl
    keywords = accepted_keywords(fn)
    return lambda response, answer, context: fn(response, answer, **{k: context[k] for k in keywords})


def load_scorer(spec):
    """``call(response, answer, context)`` for a spec from :func:`megarl.trainer.steps.reward_spec`:
    one function's path, or ``{"default": path, "by_source": {data_source: path}}`` (each row scored
    by its ``data_source``'s function, else the default)."""
    if isinstance(spec, str):
        return caller(load_object(spec))
    loaded = {}
    for path in [p for p in [spec["default"], *spec["by_source"].values()] if p]:
        loaded.setdefault(path, caller(load_object(path)))
    table = {source: loaded[path] for source, path in spec["by_source"].items()}
    default = loaded[spec["default"]] if spec["default"] else None  # None: such rows are never sent here

    def route(response, answer, context):
        return table.get((context["extra"] or {}).get("data_source"), default)(response, answer, context)

    return route


def accepted_keywords(fn) -> Tuple[str, ...]:
    """Which of ``prompt``/``extra`` ``fn`` takes: both with ``**kwargs``, none for ``fn(response, answer)``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: call them with two arguments
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return KEYWORDS
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(k for k in KEYWORDS if k in names)


def as_reward(value: Any) -> Tuple[str, Any]:
    """``("ok", score)``, or the kind of failure and a description: a string or None is not a
    reward even when it reads as a number, and NaN or inf would poison the advantages. A ``dict``
    (verl's convention) gives its ``"score"``."""
    if isinstance(value, dict):
        if "score" not in value:
            return "non-numeric", f"returned a dict without a 'score' (keys {sorted(value)[:8]})"
        value = value["score"]
    if value is None or isinstance(value, (str, bytes)):
        return "non-numeric", f"returned {type(value).__name__} {value!r:.60}"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return "non-numeric", f"returned {type(value).__name__} {value!r:.60}"
    if not math.isfinite(score):
        return "non-finite", f"returned {score}"
    return "ok", score


def write_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None  # the other end closed
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Optional[Any]:
    """The next object, or None when the other end has closed."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    data = _read_exact(fd, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def limit_address_space(memory_mb: int) -> None:
    """Cap this process's address space ``memory_mb`` MB above what it maps now (the interpreter
    and the function's imports), so an allocation past it raises MemoryError here instead of
    taking the node's memory."""
    import resource

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    # Keep the frame channels private: a function that prints or reads stdin must not corrupt them.
    reader, writer = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    path, memory_mb = read_frame(reader)
    try:
        call = load_scorer(path)
    except Exception as err:  # reported to the driver, which names the function
        write_frame(writer, ("fail", f"{type(err).__name__}: {err}"))
        return
    if memory_mb:  # after the imports: the ceiling is on what scoring allocates
        limit_address_space(memory_mb)
    write_frame(writer, ("ready",))
    while True:
        task = read_frame(reader)
        if task is None:  # the driver closed the pool (or died)
            return
        index, response, answer, context = task
        start = time.perf_counter()
        try:
            value = call(response, answer, context)
        except MemoryError:  # over algorithm.reward_memory_mb: this process is replaced
            write_frame(writer, (index, "memory", f"over algorithm.reward_memory_mb={memory_mb} MB of address "
                                                  f"space", time.perf_counter() - start))
            return
        except Exception as err:  # a user's function may raise anything; the run goes on
            kind, result = "exception", f"{type(err).__name__}: {err}"
        else:
            kind, result = as_reward(value)
        write_frame(writer, (index, kind, result, time.perf_counter() - start))
