"""docs/configuration.md's "read by" column against the code: each key is read by every command
the page names for it. A command's code is its entry point's module and every megarl module it
imports, at any depth, eagerly or inside a function, or names in a registry string
(``"megarl.rollout.backends.vllm:VLLMBackend"``), plus its function in megarl/cli.py; a key counts as
read when one of those modules (megarl/config aside) takes its field as an attribute or names it
in a string (``getattr``). ``megarl train-lm``'s code is a fraction of ``megarl train``'s, so the
keys it is listed for are checked against what it really runs (before: ``trainer.log_interval``
was documented as printing metrics while only ``train-lm`` read it; ``data.global_batch_size``
was documented for ``megarl train``, which ignored it)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import FrozenSet, Iterable, Set

import pytest

from megarl.config.docs import DPO, EVAL, LM, RM, SFT, TRAIN, keys, read_by

ROOT = Path(__file__).resolve().parents[2]
ENTRY = {TRAIN: ("megarl.entrypoints.train_rl", "_train"), EVAL: ("megarl.entrypoints.eval", "_eval"),
         LM: ("megarl.entrypoints.train_lm", "_train_lm"), SFT: ("megarl.entrypoints.sft", "_sft"),
         RM: ("megarl.entrypoints.sft", "_train_rm"), DPO: ("megarl.entrypoints.sft", "_dpo")}
_REGISTERED = re.compile(r"megarl(\.\w+)+(:\w+)?")


def _path(module: str):
    for p in (ROOT / (module.replace(".", "/") + ".py"), ROOT / module.replace(".", "/") / "__init__.py"):
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=None)
def _tree(module: str) -> ast.AST:
    return ast.parse(_path(module).read_text())


def closure(entries: Iterable[str]) -> Set[str]:
    seen, todo = set(), list(entries)
    while todo:
        module = todo.pop()
        if module in seen or _path(module) is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("megarl")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megarl"):
                todo += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _REGISTERED.fullmatch(node.value):
                todo.append(node.value.split(":")[0])
    return seen


def _names(node: ast.AST) -> Set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


@functools.lru_cache(maxsize=None)
def read_names(command: str) -> FrozenSet[str]:
    module, cli_function = ENTRY[command]
    names = set()
    for m in closure([module]):
        if not m.startswith("megarl.config"):
            names |= _names(_tree(m))
    (fn,) = [n for n in ast.walk(_tree("megarl.cli")) if isinstance(n, ast.FunctionDef) and n.name == cli_function]
    return frozenset(names | _names(fn))


def test_the_closure_follows_lazy_imports_and_registry_strings():
    train = closure([ENTRY[TRAIN][0]])
    assert {"megarl.rollout.backends.vllm", "megarl.transports.vllm_reload", "megarl.trainer.trackers"} <= train
    assert "megarl.entrypoints.train_lm" not in train  # the check can tell the commands apart
    assert "megarl.entrypoints.train_rl" not in closure([ENTRY[LM][0]])


@pytest.mark.parametrize("command", [TRAIN, EVAL, LM, SFT, RM, DPO])
def test_each_key_is_read_by_the_commands_the_page_names(command):
    unread = [k for k in keys() if command in read_by(k) and k.split(".")[-1] not in read_names(command)]
    assert unread == [], f"docs/configuration.md says megarl {command} reads these keys; its code does not: {unread}"


def test_train_lm_only_keys_are_not_claimed_for_train():
    """The keys only train-lm reads are named so on the page, and megarl train's code has none of them."""
    only = [k for k in keys() if TRAIN not in read_by(k) and LM in read_by(k)]
    assert sorted(only) == ["data.global_batch_size", "data.label_noise", "data.micro_batch_size",
                            "data.tool_call_rate", "trainer.save_dir"]
    # (micro_batch_size is also a field of the engine's MicroBatching, which megarl train builds from data.micro_batch_tokens)
    assert [k for k in only if k.split(".")[-1] in read_names(TRAIN) - {"micro_batch_size"}] == []
