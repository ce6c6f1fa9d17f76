"""Parsing the tool calls out of a model turn's text, in the common formats.

A format is a function ``text -> List[ToolCall]`` in :data:`TOOL_CALL_FORMATS`: ``[]`` when the
turn calls no tool, :class:`ToolCallError` (its message is shown to the model) for a malformed
call. A user registers another with ``TOOL_CALL_FORMATS.register("name")(fn)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

from megarl.registry import Registry


class ToolCallError(ValueError):
    """A malformed tool call; the message is short and meant for the model."""


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)


ToolCallParser = Callable[[str], List[ToolCall]]
TOOL_CALL_FORMATS: Registry[ToolCallParser] = Registry("tool-call format")


def _json_error(index: int, err: json.JSONDecodeError) -> ToolCallError:
    return ToolCallError(f"tool call {index}: invalid JSON at char {err.pos}: {err.msg}")


def _as_call(index: int, obj: Any) -> ToolCall:
    """A decoded ``{"name": ..., "arguments": {...}}``. ``arguments`` may be a JSON string (as
    some models write it) and is called ``parameters`` by Llama-3 style templates."""
    if not isinstance(obj, dict):
        raise ToolCallError(f"tool call {index}: expected a JSON object with \"name\" and \"arguments\", "
                            f"got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError(f"tool call {index}: missing \"name\" (a non-empty string)")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ToolCallError(f"tool call {index}: \"arguments\" is a string but not valid JSON "
                                f"(char {err.pos}: {err.msg})") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"tool call {index}: \"arguments\" must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name.strip(), arguments)


_HERMES_TAG = re.compile(r"</?tool_call>")


@TOOL_CALL_FORMATS.register("hermes")
def parse_hermes(text: str) -> List[ToolCall]:
    """Qwen2.5/Qwen3/Hermes: one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks anywhere in the turn."""
    calls: List[ToolCall] = []
    opened = -1  # where the open block's JSON starts
    for tag in _HERMES_TAG.finditer(text):
        index = len(calls) + 1
        if tag.group() == "<tool_call>":
            if opened >= 0:
                raise ToolCallError(f"tool call {index}: <tool_call> is not closed by </tool_call>")
            opened = tag.end()
            continue
        if opened < 0:
            raise ToolCallError(f"tool call {index}: </tool_call> without a <tool_call>")
        body = text[opened:tag.start()]
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            # count the position from the first non-blank character, which is what the model sees
            err.pos -= len(body) - len(body.lstrip())
            raise _json_error(index, err) from None
        calls.append(_as_call(index, obj))
        opened = -1
    if opened >= 0:
        raise ToolCallError(f"tool call {len(calls) + 1}: <tool_call> is not closed by </tool_call>")
    return calls


@TOOL_CALL_FORMATS.register("json")
def parse_json(text: str) -> List[ToolCall]:
    """The turn is, or ends with, one bare JSON object ``{"name": ..., "arguments": {...}}``. A
    trailing object without ``"name"`` (e.g. ``\\boxed{42}`` is no object at all) is not a call,
    unless it is the whole turn."""
    stripped = text.strip()
    if not stripped.endswith("}"):
        return []
    decoder = json.JSONDecoder()
    start = stripped.find("{")
    while start >= 0:
        try:
            obj, end = decoder.raw_decode(stripped, start)
        except json.JSONDecodeError as err:
            if start == 0:  # the whole turn looks like a call: say what is wrong with it
                raise _json_error(1, err) from None
        else:
            if end == len(stripped) and (start == 0 or (isinstance(obj, dict) and "name" in obj)):
                return [_as_call(1, obj)]
        start = stripped.find("{", start + 1)
    return []


def parse_tool_calls(text: str, fmt: str = "hermes") -> List[ToolCall]:
    """The tool calls of ``text`` in format ``fmt`` (a :data:`TOOL_CALL_FORMATS` name); ``[]`` for
    none; :class:`ToolCallError` for a malformed one."""
    return TOOL_CALL_FORMATS.get(fmt)(text)
