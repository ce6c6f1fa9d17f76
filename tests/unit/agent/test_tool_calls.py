"""Tool-call parsing: good, multiple and malformed calls in the hermes and json formats."""

import pytest

from megarl.agent.tool_calls import TOOL_CALL_FORMATS, ToolCall, ToolCallError, parse_tool_calls


def test_hermes_single_call_with_surrounding_text():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*3"}}\n'
            '</tool_call><|im_end|>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "17*3"})]


def test_hermes_several_calls_in_order_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2, 3]}"}</tool_call>\n'
            '<tool_call>{"name": "c"}</tool_call>')
    assert parse_tool_calls(text, "hermes") == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2, 3]}), ToolCall("c", {})]


def test_hermes_no_call():
    assert parse_tool_calls("The answer is 42.<|im_end|>") == []
    assert parse_tool_calls("") == []


@pytest.mark.parametrize("text, message", [
    ('<tool_call>\n{"name": "calc" "arguments": {}}</tool_call>',
     "tool call 1: invalid JSON at char 16: Expecting ',' delimiter"),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"arguments": {}}</tool_call>',
     'tool call 2: missing "name"'),
    ('<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>', 'tool call 1: "arguments" must be a JSON object, got list'),
    ('<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>', 'tool call 1: "arguments" is a string but not valid JSON'),
    ('<tool_call>{"name": "a", "arguments": {}}', "tool call 1: <tool_call> is not closed by </tool_call>"),
    ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>', "tool call 1: <tool_call> is not closed"),
    ('{"name": "a"}</tool_call>', "tool call 1: </tool_call> without a <tool_call>"),
    ('<tool_call>["a"]</tool_call>', "tool call 1: expected a JSON object"),
])
def test_hermes_malformed_calls_raise_a_message_for_the_model(text, message):
    with pytest.raises(ToolCallError) as err:
        parse_tool_calls(text)
    assert str(err.value).startswith(message), str(err.value)


def test_json_format():
    assert parse_tool_calls('{"name": "calculator", "arguments": {"expression": "1+1"}}', "json") == [
        ToolCall("calculator", {"expression": "1+1"})]
    # a turn that ends with the call; Llama-3 style "parameters"
    assert parse_tool_calls('I will call it: {"name": "f", "parameters": {"a": {"b": 1}}}\n', "json") == [
        ToolCall("f", {"a": {"b": 1}})]
    # a final answer, even one ending with braces, is no call
    assert parse_tool_calls("so the answer is \\boxed{42}", "json") == []
    assert parse_tool_calls('the set is {"a": 1}', "json") == []
    assert parse_tool_calls("42", "json") == []
    with pytest.raises(ToolCallError, match="tool call 1: invalid JSON at char 9"):
        parse_tool_calls('{"name": }', "json")
    with pytest.raises(ToolCallError, match='missing "name"'):
        parse_tool_calls('{"arguments": {}}', "json")


def test_unknown_format_and_registering_one():
    with pytest.raises(KeyError, match="unknown tool-call format 'xml'; available: hermes, json"):
        parse_tool_calls("x", "xml")
    assert TOOL_CALL_FORMATS.names() == ["hermes", "json"]
