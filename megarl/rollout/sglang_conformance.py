"""Every SGLang call megarl makes, checked against a release's source without importing it (SGLang
needs a GPU; its wheel is pure Python and reads anywhere).

:func:`megarl_calls` reads megarl's own call sites with :mod:`ast`: every ``<...>.engine.<method>(...)``
and ``engine.<method>(...)`` in the SGLang engine and its two weight transports, ``sglang.Engine(...)``'s
keywords (SGLang passes them to ``ServerArgs``), the keys of the sampling-parameter dicts of
``request_params`` and the memory-saver tags. :func:`sglang_api` reads the same names out of a
wheel: ``Engine``'s methods and their parameters, ``ServerArgs``' fields, ``SamplingParams``'
parameters, the ``GPU_MEMORY_TYPE_*`` tags. :func:`check` lists each call the release would not
take, by file and line. It also checks what the calls answer (the return annotation of the
TokenizerManager coroutine each Engine method runs, against how ``sglang_engine.ENGINE_ANSWERS``
reads it) and that every name megarl imports from ``sglang`` (lazily, inside functions) is defined
where it is imported from.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
CALL_SITES = ("rollout/sglang_engine.py", "transports/cuda_ipc.py", "transports/nccl_broadcast.py")
ENGINE_SOURCE = "sglang/srt/entrypoints/engine.py"
SERVER_ARGS_SOURCE = "sglang/srt/server_args.py"
SAMPLING_SOURCE = "sglang/srt/sampling/sampling_params.py"
CONSTANTS_SOURCE = "sglang/srt/constants.py"
# the TokenizerManager and the mixin whose coroutines the Engine's methods run
MANAGER_SOURCES = ("sglang/srt/managers/tokenizer_communicator_mixin.py", "sglang/srt/managers/tokenizer_manager.py")


@dataclass
class Call:
    where: str  # file:line
    method: str
    positional: int
    keywords: Tuple[str, ...]


@dataclass
class MegarlUse:
    calls: List[Call] = field(default_factory=list)  # methods of an sglang.Engine
    server_args: List[Tuple[str, str]] = field(default_factory=list)  # (where, keyword of sglang.Engine(...))
    sampling_keys: List[Tuple[str, str]] = field(default_factory=list)  # (where, key)
    memory_tags: Tuple[str, ...] = ()
    imports: List[Tuple[str, str, str]] = field(default_factory=list)  # (where, sglang module, name)


@dataclass
class Signature:
    params: Tuple[str, ...]  # after self, positional-or-keyword then keyword-only
    positional: int  # how many may be passed by position
    var_keyword: bool


@dataclass
class SGLangAPI:
    engine: Dict[str, Signature]
    server_args: Tuple[str, ...]
    sampling_params: Tuple[str, ...]
    memory_tags: Tuple[str, ...]
    answers: Dict[str, str] = field(default_factory=dict)  # Engine method -> what it returns ("None": nothing)
    read: Optional[Callable[[str], str]] = None  # the release's files, for the imports


def _answer(fn: ast.AsyncFunctionDef) -> str:
    """A coroutine's return annotation; "None" when it returns no value; "?" unannotated."""
    if fn.returns is not None:
        return ast.unparse(fn.returns)
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    return "?" if returns else "None"


def _engine_answers(engine: ast.ClassDef, read: Callable[[str], str]) -> Dict[str, str]:
    """Engine method -> the answer of the ``self.tokenizer_manager.<coroutine>`` it runs."""
    coroutines: Dict[str, str] = {}
    for source in MANAGER_SOURCES:
        for node in ast.walk(ast.parse(read(source))):
            if isinstance(node, ast.ClassDef):
                coroutines.update({f.name: _answer(f) for f in node.body if isinstance(f, ast.AsyncFunctionDef)})
    answers = {}
    for method in engine.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        for node in ast.walk(method):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "tokenizer_manager"
                    and node.func.attr in coroutines):
                answers[method.name] = coroutines[node.func.attr]
                break
    return answers


def _defines(read: Callable[[str], str], module: str, name: str, depth: int = 0) -> bool:
    """Whether ``from module import name`` works in the release: a top-level definition, an
    import, a submodule, or one of the module's ``from ... import *``."""
    base = module.replace(".", "/")
    for path in (f"{base}/{name}.py", f"{base}/{name}/__init__.py"):
        try:
            read(path)
            return True
        except KeyError:
            pass
    for path in (f"{base}.py", f"{base}/__init__.py"):
        try:
            tree = ast.parse(read(path))
        except KeyError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return True
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if any((a.asname or a.name) == name for a in node.names):
                    return True
                if (isinstance(node, ast.ImportFrom) and node.module and depth < 3
                        and any(a.name == "*" for a in node.names) and _defines(read, node.module, name, depth + 1)):
                    return True
        return False
    return False


def _is_engine(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "engine")


def megarl_calls(root: Path = ROOT) -> MegarlUse:
    use = MegarlUse()
    for rel in CALL_SITES:
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                where = f"megarl/{rel}:{node.lineno}"
                keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
                if _is_engine(node.func.value):
                    use.calls.append(Call(where, node.func.attr, len(node.args), keywords))
                elif (node.func.attr == "Engine" and isinstance(node.func.value, ast.Name)
                      and node.func.value.id == "sglang"):
                    use.server_args += [(where, k) for k in keywords]
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang":
                use.imports += [(f"megarl/{rel}:{node.lineno}", node.module, a.name) for a in node.names]
            if isinstance(node, ast.FunctionDef) and node.name == "request_params":
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Dict):
                        use.sampling_keys += [(f"megarl/{rel}:{k.lineno}", k.value) for k in inner.keys
                                              if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Tuple) and [getattr(e, "id", "") for e in t.elts]
                                                    == ["WEIGHTS", "GENERATION"] for t in node.targets):
                use.memory_tags = tuple(e.value for group in node.value.elts for e in group.elts)
    return use


def _signature(fn: ast.FunctionDef) -> Signature:
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args][1:]  # self
    return Signature(tuple(positional + [x.arg for x in a.kwonlyargs]), len(positional), a.kwarg is not None)


def _class(tree: ast.Module, name: str, source: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"{source}: no class {name}")


def sglang_api(read: Callable[[str], str]) -> SGLangAPI:
    """``read(path)``: the text of a file of the release (see :func:`wheel_reader`)."""
    engine = _class(ast.parse(read(ENGINE_SOURCE)), "Engine", ENGINE_SOURCE)
    methods = {f.name: _signature(f) for f in engine.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    server = _class(ast.parse(read(SERVER_ARGS_SOURCE)), "ServerArgs", SERVER_ARGS_SOURCE)
    fields = tuple(s.target.id for s in server.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    sampling = _class(ast.parse(read(SAMPLING_SOURCE)), "SamplingParams", SAMPLING_SOURCE)
    init = next(f for f in sampling.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    tags = tuple(node.value.value for node in ast.parse(read(CONSTANTS_SOURCE)).body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and any(getattr(t, "id", "").startswith("GPU_MEMORY_TYPE_") for t in node.targets))
    return SGLangAPI(methods, fields, _signature(init).params, tags, _engine_answers(engine, read), read)


def wheel_reader(wheel: Path, replace: Optional[Dict[str, Tuple[str, str]]] = None) -> Callable[[str], str]:
    """Files of a downloaded wheel; ``replace``: path -> (old, new), a text edit applied on read
    (to test that a renamed parameter is caught)."""
    archive = zipfile.ZipFile(wheel)

    def read(path: str) -> str:
        text = archive.read(path).decode()
        if replace and path in replace:
            old, new = replace[path]
            assert old in text, f"{path}: {old!r} not found"
            text = text.replace(old, new)
        return text

    return read


def check(use: MegarlUse, api: SGLangAPI, answers=None) -> List[str]:
    """Each call the release would not take, each answer megarl would misread (``answers``:
    ``sglang_engine.ENGINE_ANSWERS`` by default) and each import the release lacks, named by where
    megarl makes it."""
    if answers is None:
        from megarl.rollout.sglang_engine import ENGINE_ANSWERS as answers
    errors = []
    for call in use.calls:
        sig = api.engine.get(call.method)
        if sig is None:
            errors.append(f"{call.where}: sglang.Engine has no method {call.method}")
            continue
        if call.positional > sig.positional:
            errors.append(f"{call.where}: Engine.{call.method} takes {sig.positional} positional arguments, "
                          f"megarl passes {call.positional}")
        for keyword in call.keywords:
            if keyword not in sig.params and not sig.var_keyword:
                errors.append(f"{call.where}: Engine.{call.method} has no parameter {keyword!r} "
                              f"(it takes {', '.join(sig.params) or 'none'})")
        taken = set(sig.params[:call.positional]) & set(call.keywords)
        if taken:
            errors.append(f"{call.where}: Engine.{call.method} gets {sorted(taken)} by position and by keyword")
        expected = answers.get(call.method)
        if expected is None:
            errors.append(f"{call.where}: Engine.{call.method}: sglang_engine.ENGINE_ANSWERS does not say how to "
                          f"read its answer")
        elif expected.returns is not None and api.answers.get(call.method) != expected.returns:
            errors.append(f"{call.where}: Engine.{call.method} answers {api.answers.get(call.method)} in this "
                          f"release; megarl reads {expected.returns}")
    if api.read is not None:
        errors += [f"{where}: from {module} import {name}: the release has no {module}.{name}"
                   for where, module, name in use.imports if not _defines(api.read, module, name)]
    errors += [f"{where}: sglang.Engine({key}=...): ServerArgs has no field {key!r}"
               for where, key in use.server_args if key not in api.server_args]
    errors += [f"{where}: sampling parameter {key!r}: SamplingParams has no such parameter"
               for where, key in use.sampling_keys if key not in api.sampling_params]
    errors += [f"megarl/rollout/sglang_engine.py: memory-saver tag {tag!r} is not one of SGLang's {list(api.memory_tags)}"
               for tag in use.memory_tags if tag not in api.memory_tags]
    return errors


def methods_called(use: MegarlUse) -> Sequence[str]:
    return sorted({c.method for c in use.calls})
