"""Name -> entry registries, the extension points (advantage estimators, policy losses, KL
estimators, reward functions, environments, tool-call formats, built-in tasks), and
:func:`load_object` for a user's entry named by import path. No torch: reward workers import it.

A new entry registers itself with a decorator and must pass its kind's contract tests (e.g.
``tests/unit/algorithms/test_contract.py``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Generic, List, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Functions of one kind (e.g. "advantage estimator"), looked up by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: Dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that files ``fn`` under ``name``; a name can be taken only once."""

        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        """The function named ``name``; the ``KeyError`` lists the names that exist."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}"
            ) from None

    def names(self) -> List[str]:
        return sorted(self._entries)


def load_object(path: str):
    """The object at ``package.module:name`` (``name`` may be dotted, e.g. ``Class.method``)."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
