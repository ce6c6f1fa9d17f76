"""Observation tokens through a Qwen-style chat template (tools in the system prompt, tool
results as ``<tool_response>`` in a user turn): the tokens the loop appends turn by turn equal
the tokenization of the whole transcript rendered at once, with the policy's own ids untouched."""

from __future__ import annotations

import pytest

from megarl.agent.chat import ChatCodec
from megarl.data.tokenizer import DigitTokenizer, HFTokenizer
from tests.fixtures.hf_models import IM_END_ID, make_tokenizer

# Qwen2.5's layout of tools and tool messages, shortened
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = make_tokenizer(tmp_path_factory.mktemp("qwen_tok"))
    (path / "chat_template.jinja").write_text(QWEN_STYLE)
    return HFTokenizer(str(path))


def encode(tok, text):
    return tok.tok.encode(text, add_special_tokens=False)


def test_incremental_tokens_equal_the_whole_render(tok):
    codec = ChatCodec(tok)
    messages = [{"role": "user", "content": "what is 12*7?"}]
    ids = codec.prompt_ids(messages, TOOLS)
    assert tok.tok.decode(ids).startswith("<|im_start|>system\n# Tools\n<tools>\n{\"type\": \"function\"")
    turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>', "It is 84."]
    policy = []
    for k, (text, observation) in enumerate(zip(turns, ["84", None])):
        generated = encode(tok, text) + [IM_END_ID]  # the policy stops at <|im_end|>, kept as its last token
        ids += generated
        policy += list(range(len(ids) - len(generated), len(ids)))
        messages.append({"role": "assistant", "content": text})
        if observation is not None:
            ids += codec.observation_ids(observation, last_token=IM_END_ID)
            messages.append({"role": "tool", "content": observation})
    whole = tok.tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert tok.tok.decode(ids) == whole.rstrip("\n")  # the last turn's "\n" follows only once it is closed
    assert ids == encode(tok, whole)[:-1]
    obs = codec.observation_ids("84", last_token=IM_END_ID)
    assert tok.tok.decode(obs) == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_cut_by_length_is_closed_by_the_observation(tok):
    codec = ChatCodec(tok)
    obs = codec.observation_ids("84", last_token=None)  # no stop token: the template's <|im_end|>\n goes first
    assert obs[0] == IM_END_ID and tok.tok.decode(obs).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


def test_reset_text_joins_the_first_user_message(tok):
    codec = ChatCodec(tok)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "guess"}]
    assert codec.prompt_ids(chat, (), extra=" 1-100") == tok.prompt_ids(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "guess 1-100"}])
    assert codec.prompt_ids("guess", TOOLS) == encode(tok, tok.tok.apply_chat_template(
        [{"role": "user", "content": "guess"}], tools=TOOLS, tokenize=False, add_generation_prompt=True))


def test_without_a_template_the_text_is_encoded_as_it_is():
    digits = DigitTokenizer()
    codec = ChatCodec(digits)
    assert codec.observation_ids("|84|", last_token=digits.eos_token_id) == digits.encode("|84|")
    assert codec.prompt_ids("12=", TOOLS, extra="3") == digits.prompt_ids("12=3")  # no template: no tools
