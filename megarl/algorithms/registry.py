"""A tiny name -> function registry: the extension point for estimators, losses and KL estimators.

A new entry registers itself with a decorator and must pass the contract tests in
``tests/unit/algorithms/test_contract.py``.
"""

from __future__ import annotations

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
