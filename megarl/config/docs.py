"""docs/configuration.md, generated from the schema: every key of the config tree with its type
(an Enum's allowed values), default, bounds and the field's own docstring in ``schema.py``.

``python -m megarl.config.docs`` prints it; ``--write`` replaces docs/configuration.md.
``tests/unit/test_docs.py`` checks that the committed page equals this output, and that every
field has a doc.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from megarl.config import schema
from megarl.config.schema import MegarlConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

TRAIN, EVAL, LM, SFT, RM, DPO = "train", "eval", "train-lm", "sft", "train-rm", "dpo"
# Which commands read a key (the page's "read by" column): the entry of the longest prefix of the
# key decides. tests/unit/test_config_reads.py checks that each command's code reads each key it
# is listed for.
_EVAL_DATA = ("val_files", "prompt_key", "answer_key", "bad_rows", "tokenizer", "chat_template",
              "chat_template_path", "chat_template_kwargs", "system_prompt", "max_prompt_length", "truncation")
_EVAL_ALGORITHM = ("reward_fn", "reward_fn_by_source", "reward_timeout_s", "reward_workers", "reward_memory_mb", "top_p",
                   "top_k", "max_new_tokens", "val_samples_per_prompt", "val_temperature", "val_max_new_tokens")
_SFT_DATA = ("train_files", "shuffle", "val_files", "prompt_key", "response_key", "messages_key", "bad_rows", "tokenizer",
             "chat_template", "chat_template_path", "chat_template_kwargs", "system_prompt", "truncation", "max_length",
             "global_batch_size", "micro_batch_size", "pack_sequences")
_SFT_TRAINER = ("train_steps", "total_epochs", "seed", "nproc_per_node", "log_interval", "max_bad_steps", "run_dir",
                "nnodes", "ray_address", "node_ip_address", "hang_timeout_s", "save_interval", "val_interval",
                "val_before_train", "keep_checkpoints", "resume", "checkpoint_format", "async_save")
READ_BY: Dict[str, Tuple[str, ...]] = {
    "": (TRAIN,),
    "model": (TRAIN, EVAL, LM, SFT, RM, DPO), "model.path": (TRAIN, EVAL, SFT, RM, DPO),
    "model.check_finite": (TRAIN, EVAL, SFT, RM, DPO), "model.lora": (TRAIN, EVAL, SFT, RM, DPO),
    "parallel.actor": (TRAIN, EVAL, LM, SFT, RM, DPO), "parallel.rollout": (TRAIN, EVAL),
    "parallel.rollout.partial_chunk_tokens": (TRAIN,),
    "optimizer": (TRAIN, LM, SFT, RM, DPO),
    **{f"data.{k}": (TRAIN, EVAL) for k in _EVAL_DATA},
    "data.task": (TRAIN, LM), "data.num_digits": (TRAIN, LM), "data.pack_sequences": (TRAIN, LM),
    "data.tool_call_rate": (LM,), "data.label_noise": (LM,), "data.global_batch_size": (LM,),
    "data.micro_batch_size": (LM,),
    **{f"algorithm.{k}": (TRAIN, EVAL) for k in _EVAL_ALGORITHM},
    "trainer.train_steps": (TRAIN, LM), "trainer.seed": (TRAIN, EVAL, LM), "trainer.nproc_per_node": (TRAIN, EVAL, LM),
    "trainer.log_interval": (TRAIN, LM), "trainer.max_bad_steps": (TRAIN, LM), "trainer.save_dir": (LM,),
    **{f"trainer.{k}": (TRAIN, EVAL) for k in ("run_dir", "nnodes", "ray_address", "node_ip_address", "hang_timeout_s")},
    "reward_model": (TRAIN, EVAL),
    "logging": (TRAIN, SFT, RM, DPO),
    **{f"algorithm.dpo_{k}": (DPO,) for k in ("beta", "loss", "label_smoothing")},
}


def read_by(key: str) -> Tuple[str, ...]:
    """The commands (``megarl <command>``) that read ``key``."""
    parts = key.split(".")
    return next(READ_BY[".".join(parts[:n])] for n in range(len(parts), -1, -1) if ".".join(parts[:n]) in READ_BY)


# megarl sft's, train-rm's and dpo's keys: added to each key's other commands (megarl train's train_files,
# shuffle...); the keys they alone read
_SFT_ONLY = ("data.response_key", "data.messages_key", "data.max_length")
READ_BY.update({k: (SFT, RM, DPO) for k in _SFT_ONLY})
READ_BY.update({k: (RM, DPO) for k in ("data.chosen_key", "data.rejected_key")})
READ_BY.update({k: tuple(c for c in read_by(k) if c not in (SFT, RM, DPO)) + (SFT, RM, DPO)
                for k in [f"data.{k}" for k in _SFT_DATA] + [f"trainer.{k}" for k in _SFT_TRAINER] if k not in _SFT_ONLY})

_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def field_docs(cls: type) -> Dict[str, str]:
    """The attribute docstrings of a dataclass: the string literal right after each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value
    return docs


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("``", "`").replace("|", "\\|")


def _strip_optional(tp: Any) -> Tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


def type_name(tp: Any) -> str:
    """``int``, ``list of str``, ``one of `a`, `b``` (an Enum's values), ``... or null``."""
    inner, optional = _strip_optional(tp)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        name = "one of " + ", ".join(f"`{m.value}`" for m in inner)
    elif typing.get_origin(inner) in (list, List):
        name = "list of " + type_name(typing.get_args(inner)[0])
    elif isinstance(inner, type):
        name = inner.__name__
    else:
        name = str(inner).replace("typing.", "")
    return f"{name} or null" if optional else name


def _render(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    return str(value)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return ""
    return f"`{_render(value)}`"


def _bounds(f: dataclasses.Field) -> str:
    bounds = f.metadata.get("bounds", {})
    return ", ".join(f"{_OPS[op]} {_render(v)}" for op, v in bounds.items())


def sections(root: type = MegarlConfig, prefix: str = "") -> Iterator[Tuple[str, type, List[Tuple[str, dataclasses.Field, Any, str]]]]:
    """(section key, its dataclass, [(key, field, type, doc)]) for the tree, depth first; a nested
    dataclass is its own section."""
    hints = typing.get_type_hints(root, vars(schema))
    docs = field_docs(root)
    rows, nested = [], []
    for f in dataclasses.fields(root):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.append((key, tp, docs.get(f.name, "")))
        else:
            rows.append((key, f, tp, docs.get(f.name, "")))
    if prefix:
        yield prefix[:-1], root, rows
    for key, tp, _ in nested:
        yield from sections(tp, key + ".")


def section_docs(root: type = MegarlConfig, prefix: str = "") -> Dict[str, str]:
    """Each nested section's doc: the docstring of the field that holds it, else its class's."""
    out = {}
    docs = field_docs(root)
    hints = typing.get_type_hints(root, vars(schema))
    for f in dataclasses.fields(root):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            key = f"{prefix}{f.name}"
            out[key] = docs.get(f.name) or inspect.getdoc(tp) or ""
            out.update(section_docs(tp, key + "."))
    return out


def keys(root: type = MegarlConfig) -> List[str]:
    """Every key of the tree, sections included (``trainer``, ``trainer.offload``, ``trainer.offload.params``)."""
    out = []
    for section, _, rows in sections(root):
        out.append(section)
        out.extend(key for key, *_ in rows)
    return out


def undocumented(root: type = MegarlConfig) -> List[str]:
    """Keys whose field has no docstring."""
    missing = [key for _, _, rows in sections(root) for key, _, _, doc in rows if not doc.strip()]
    missing += [key for key, doc in section_docs(root).items() if not doc.strip()]
    return sorted(missing)


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m megarl.config.docs --write` from the field docs in",
        "     megarl/config/schema.py; edit those, not this page (tests/unit/test_docs.py compares them). -->",
        "",
        "One typed tree of dataclasses ([`megarl/config/schema.py`](../megarl/config/schema.py)). YAML files",
        "merge in order, then `key=value` overrides (`megarl config FILE.yaml key=value` prints the result);",
        "an unknown key, a value of the wrong type or one outside the bounds below is an error that names",
        "the key, and nothing starts (exit 2). \"read by\" names the `megarl` commands whose code reads the",
        "key (`megarl config` and `megarl layout` read every file; tests/unit/test_config_reads.py checks the column).",
        "",
    ]
    docs = section_docs()
    all_sections = list(sections())
    lines.append("Sections: " + ", ".join(f"[`{key}`](#{key.replace('.', '')})" for key, _, _ in all_sections) + ".")
    lines.append("")
    for key, _, rows in all_sections:
        lines += [f"## {key}", "", _one_line(docs.get(key, "")).replace("\\|", "|"), ""]
        if not rows:
            continue
        lines += ["| key | type | default | bounds | read by | meaning |", "| --- | --- | --- | --- | --- | --- |"]
        for name, f, tp, doc in rows:
            commands = ", ".join(read_by(name))
            lines.append(f"| `{name}` | {type_name(tp)} | {_default(f)} | {_bounds(f)} | {commands} | {_one_line(doc)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    text = render()
    if "--write" in argv:
        PAGE.parent.mkdir(exist_ok=True)
        PAGE.write_text(text, encoding="utf-8")
        print(f"{PAGE}: {len(text.splitlines())} lines")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
