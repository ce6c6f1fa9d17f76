"""Contract tests that every registered tool-call format and built-in environment must pass."""

import asyncio

import pytest

from megarl.agent.env import Environment, StepResult
from megarl.agent.envs import ENVIRONMENTS, env_factory
from megarl.agent.tool_calls import TOOL_CALL_FORMATS, ToolCall, ToolCallError
from megarl.data.datasets import PromptRecord

# Text a model may write: a parser answers [] or calls, or raises ToolCallError, and nothing else.
TRICKY = ["", "plain answer 42", "}", "{", "{}", "[]", "null", '{"name": 1}', '{"name": "a", "arguments": 3}',
          "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "<tool_call>{}</tool_call>",
          '<tool_call>{"name": "a", "arguments": "[1]"}</tool_call>', "\\boxed{1}", "{" * 50 + "}" * 50,
          '<tool_call>{"name": "a"}</tool_call></tool_call>', "\x00\udcff<tool_call>\n"]


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS.names())
def test_tool_call_format_contract(fmt):
    parse = TOOL_CALL_FORMATS.get(fmt)
    assert parse("The answer is 42.") == []
    for text in TRICKY:
        try:
            calls = parse(text)
        except ToolCallError as err:
            assert str(err).startswith("tool call "), (fmt, text, str(err))
            continue
        assert isinstance(calls, list) and all(isinstance(c, ToolCall) and c.name and isinstance(c.arguments, dict)
                                               for c in calls), (fmt, text, calls)


@pytest.mark.parametrize("name", ENVIRONMENTS.names())
def test_builtin_environment_contract(name):
    make = env_factory(name)
    first, second = make(), make()
    assert isinstance(first, Environment) and first is not second
    assert first.tools and all(t["type"] == "function" and t["function"]["name"] for t in first.tools)

    async def episode():
        extra = await first.reset(PromptRecord("q", "a", "test:1"))
        malformed = await first.step("<tool_call>{oops</tool_call>")
        final = await first.step("The answer is a.")
        await first.close()
        return extra, malformed, final

    extra, malformed, final = asyncio.run(episode())
    assert extra is None or isinstance(extra, str)
    assert isinstance(malformed, StepResult) and malformed.info["tool_error"] is True and not malformed.done
    assert malformed.observation.startswith("error: tool call 1: invalid JSON")
    assert final.done and final.observation == ""
