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


def is_file_path(path: str) -> bool:
    """Whether ``path`` (before its ``:name``) names a Python file, ``dir/my_reward.py:fn``, rather
    than a module."""
    return path.rpartition(":")[0].endswith(".py")


def load_object(path: str):
    """The object at ``package.module:name`` or ``path/to/file.py:name`` (``name`` may be dotted,
    e.g. ``Class.method``). A file is run as its own module (named after its resolved path, so
    that loading it again returns the same one), its folder first on the import path, so that it
    imports its neighbours."""
    module, _, attr = path.rpartition(":") if is_file_path(path) else path.partition(":")
    obj = _load_file(module) if module.endswith(".py") else importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _load_file(file: str):
    import hashlib
    import importlib.util
    import os
    import sys

    file = os.path.realpath(file)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no such file: {file}")
    name = f"megarl_user_{os.path.basename(file)[:-3]}_{hashlib.sha1(file.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(file)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
