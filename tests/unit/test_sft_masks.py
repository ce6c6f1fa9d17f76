"""SFT loss masks from real chat templates (megarl.data.sft; issue 45): a ChatML template (the test
tokenizer's, built with ``tokenizers``), a Llama-3-style one (incremental rendering) and a
Qwen-style one with ``{% generation %}`` markers and tool calls. On a multi-turn tool
conversation the trained tokens are exactly the assistant turns the template renders, each up to
its end-of-turn token; system, user and tool text and the generation prompts are never trained."""

from __future__ import annotations

import pytest

from megarl.data.sft import ExampleError, chat_example, fit, has_generation_markers, pair_example
from tests.fixtures.hf_models import EOS_IDS, make_tokenizer

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message['content'] or '' }}"
    "{%- for call in message.get('tool_calls', []) %}"
    "{{- '<tool_call>' + call['function']['name'] + '(' + call['function']['arguments'] + ')</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "calc 2+2"},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "It is 4."},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = make_tokenizer(tmp_path_factory.mktemp("tok"))
    chatml = AutoTokenizer.from_pretrained(directory)
    llama = AutoTokenizer.from_pretrained(directory)
    llama.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                            "<|end_header_id|>", "<|eot_id|>"]})
    llama.chat_template = LLAMA3
    qwen = AutoTokenizer.from_pretrained(directory)
    qwen.chat_template = QWEN
    return {"chatml": chatml, "llama3": llama, "qwen": qwen}


def trained_text(tok, example):
    """The trained tokens, one string per contiguous span."""
    spans, current = [], []
    for token, m in zip(example.ids, example.mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


def test_chatml_by_incremental_rendering(tokenizers):
    tok = tokenizers["chatml"]
    assert not has_generation_markers(tok)
    ex = chat_example(tok, CONVERSATION, EOS_IDS)
    assert ex.ids == list(tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False))
    assert trained_text(tok, ex) == ["calc 2+2<|im_end|>", "It is 4.<|im_end|>"]  # the newline after: formatting


def test_llama3_style_by_incremental_rendering(tokenizers):
    tok = tokenizers["llama3"]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    ex = chat_example(tok, CONVERSATION, [eot])
    assert trained_text(tok, ex) == ["calc 2+2<|eot_id|>", "It is 4.<|eot_id|>"]
    assert tok.decode(ex.ids[:1]) == "<|begin_of_text|>" and not ex.mask[0]


def test_qwen_style_generation_markers_with_tool_calls(tokenizers):
    tok = tokenizers["qwen"]
    assert has_generation_markers(tok)
    calls = [dict(CONVERSATION[2], content="", tool_calls=[{"type": "function",
                                                             "function": {"name": "calc", "arguments": "2+2"}}])]
    conversation = CONVERSATION[:2] + calls + CONVERSATION[3:]
    ex = chat_example(tok, conversation, EOS_IDS)
    assert trained_text(tok, ex) == ["<tool_call>calc(2+2)</tool_call><|im_end|>", "It is 4.<|im_end|>"]


def test_every_template_trains_only_the_assistant(tokenizers):
    """Changing system, user or tool text moves the trained tokens with it but never into the mask."""
    for name, tok in tokenizers.items():
        eos = [tok.convert_tokens_to_ids("<|eot_id|>")] if name == "llama3" else EOS_IDS
        base = chat_example(tok, CONVERSATION, eos)
        other = [dict(m, content=m["content"] + " and more") if m["role"] != "assistant" else m for m in CONVERSATION]
        changed = chat_example(tok, other, eos)
        assert trained_text(tok, changed) == trained_text(tok, base), name
        assert changed.trained == base.trained and len(changed.ids) > len(base.ids), name


def test_pairs_bad_rows_and_length(tokenizers):
    tok = tokenizers["chatml"]
    ex = pair_example(tok, "reverse 12", "21", EOS_IDS)
    assert trained_text(tok, ex) == ["21<|im_end|>"]
    with pytest.raises(ExampleError, match="no assistant message"):
        chat_example(tok, CONVERSATION[:2], EOS_IDS)
    with pytest.raises(ExampleError, match="message 1 has role 'human'"):
        chat_example(tok, [CONVERSATION[0], {"role": "human", "content": "x"}], EOS_IDS)
    with pytest.raises(ExampleError, match=r"tokens > data.max_length=5"):
        fit(ex, 5, truncate=False)
    cut = fit(ex, len(ex.ids) - 2, truncate=True)  # the newline after <|im_end|>, then <|im_end|> itself
    assert cut.ids == ex.ids[:-2] and cut.trained == ex.trained - 1
    with pytest.raises(ExampleError, match="no assistant token within data.max_length=3"):
        fit(ex, 3, truncate=True)


def test_a_template_that_rewrites_history_is_refused(tokenizers):
    """Qwen3 drops earlier turns' reasoning once a later turn follows: incremental rendering then
    cannot find the turn in the whole conversation, and says what to do."""
    tok = tokenizers["chatml"]
    rewriting = tok.chat_template.replace("message['content']",
                                          "(message['content'] if loop.last or message['role'] != 'assistant' "
                                          "else message['content'][:2])")
    tok = type(tok).from_pretrained(tok.name_or_path) if tok.name_or_path else tok
    tok.chat_template = rewriting
    with pytest.raises(ExampleError, match=r"renders message 2 \(assistant\) differently .* generation %\} markers"):
        chat_example(tok, CONVERSATION, EOS_IDS)


def test_example_stream_epochs_and_resume():
    """Each epoch deals every example once, in a seeded order; a stream restored from another's
    state deals the same examples next (a resumed megarl sft)."""
    from megarl.data.sft import ExampleStream, SFTExample

    examples = [SFTExample([i, i + 1], [0, 1], f"f:{i}") for i in range(5)]
    a = ExampleStream(examples, seed=3)
    assert sorted(e.source for e in a.take(5)) == [f"f:{i}" for i in range(5)] and a.epoch == 0
    a.take(3)
    assert a.state() == {"epoch": 1, "position": 3}
    b = ExampleStream(examples, seed=3)
    b.load_state(a.state())
    assert [e.source for e in b.take(7)] == [e.source for e in a.take(7)]
    in_order = ExampleStream(examples, seed=3, shuffle=False)
    assert [e.source for e in in_order.take(6)] == [f"f:{i}" for i in range(5)] + ["f:0"]


def test_load_examples_reads_rows_by_kind_and_names_bad_ones(tmp_path):
    import json as _json

    from megarl.config.schema import BadRows, DataConfig, Truncation
    from megarl.data.datasets import DataError
    from megarl.data.sft import collate, load_examples
    from megarl.data.tokenizer import HFTokenizer

    tok = HFTokenizer(str(make_tokenizer(tmp_path / "tok")))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(_json.dumps(r) for r in [
        {"messages": CONVERSATION},
        {"prompt": "2+2?", "response": "4"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "response": "4"},
        {"text": "neither"},
    ]) + "\n")
    with pytest.raises(DataError, match=f"{rows}:4 .*data.messages_key"):
        load_examples([str(rows)], DataConfig(), tok, 256)
    got = load_examples([str(rows)], DataConfig(bad_rows=BadRows.skip), tok, 256)
    assert [e.source for e in got] == [f"{rows}:1", f"{rows}:2", f"{rows}:3"]
    assert got[1].ids == got[2].ids and got[1].mask == got[2].mask  # a string prompt is one user message
    assert trained_text(tok.tok, got[1]) == ["4<|im_end|>"]
    batch = collate(got, pad_id=0, rows=4)  # next-token rows; a fourth, empty row
    assert batch["tokens"].shape == (4, len(got[0].ids) - 1) and batch["loss_mask"][3].sum() == 0
    assert batch["loss_mask"][1].sum() == got[1].trained and batch["labels"][0, 0] == got[0].ids[1]
    limit = len(got[1].ids)  # the conversation is longer: error, skip or cut
    with pytest.raises(DataError, match=f"{rows}:1 .*data.max_length={limit}.*data.truncation=right or skip"):
        load_examples([str(rows)], DataConfig(), tok, limit)
    kept = load_examples([str(rows)], DataConfig(bad_rows=BadRows.skip, truncation=Truncation.skip), tok, limit)
    assert [e.source for e in kept] == [f"{rows}:2", f"{rows}:3"]
    cut = load_examples([str(rows)], DataConfig(bad_rows=BadRows.skip, truncation=Truncation.right), tok, 50)
    assert len(cut) == 3 and cut[0].ids == got[0].ids[:50] and cut[0].mask == got[0].mask[:50] and cut[0].trained
    assert not load_examples([str(rows)], DataConfig(bad_rows=BadRows.skip, truncation=Truncation.right), tok,
                             limit)[0].source.endswith(":1")  # cut before any assistant token: refused
    plain = HFTokenizer(str(tmp_path / "tok"), chat_template=False)  # no template: the text, then response + EOS
    (ex,) = load_examples([str(rows)], DataConfig(bad_rows=BadRows.skip), plain, 256)
    assert ex.ids[-1] == plain.eos_token_id and trained_text(plain.tok, ex) == ["4<|im_end|>"]
