"""HF tokenizers with the pinned transformers: chat templates, plain text, the pad id, every EOS
id of generation_config.json, and the pre-flight check of prompts against the model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.data.datasets import load_records
from megarl.data.tokenizer import DigitTokenizer, HFTokenizer, load_tokenizer
from megarl.entrypoints.train_rl import prepare
from megarl.trainer.steps import check_prompt_tokens
from megarl.trainer.steps import PromptStream
from tests.fixtures.hf_models import (
    ENDOFTEXT_ID, EOS_IDS, IM_END_ID, IM_START_ID, PAD_ID, VOCAB_SIZE, make_hf_model, make_tokenizer,
)

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse 12"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def text_ids(text: str):
    return list(text.encode())  # the fixture's ids 0..255 are the bytes


def test_fixture_ids(tok_dir):
    assert (EOS_IDS, PAD_ID, VOCAB_SIZE) == ([258, 256], 259, 260)
    assert json.loads((tok_dir / "generation_config.json").read_text())["eos_token_id"] == [258, 256]


def test_chat_messages_go_through_the_template(tok_dir):
    tok = HFTokenizer(str(tok_dir))
    ids = tok.prompt_ids(CHAT)
    want = ([IM_START_ID] + text_ids("system\nbe brief") + [IM_END_ID] + text_ids("\n")
            + [IM_START_ID] + text_ids("user\nreverse 12") + [IM_END_ID] + text_ids("\n")
            + [IM_START_ID] + text_ids("assistant\n"))
    assert ids == want and all(type(i) is int for i in ids)
    assert tok.decode(ids[-4:]) == "ant\n"


def test_plain_string_is_one_user_message(tok_dir):
    tok = HFTokenizer(str(tok_dir))
    assert tok.prompt_ids("reverse 12") == tok.prompt_ids([{"role": "user", "content": "reverse 12"}])


def test_without_template_text_is_encoded_plainly(tok_dir):
    tok = HFTokenizer(str(tok_dir), chat_template=False)
    assert tok.prompt_ids("reverse 12") == text_ids("reverse 12")  # no BOS: the post-processor adds none
    assert tok.prompt_ids(CHAT) == text_ids("be brief\nreverse 12")


def test_post_processor_bos_is_kept_without_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "<unk>": 4}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert not tok.chat_template
    assert tok.prompt_ids("hello world") == [0, 2, 3]
    assert tok.eos_token_ids == [1] and tok.pad_token_id == 1  # no pad token: the first EOS id


def test_eos_ids_are_the_union_with_generation_config(tok_dir, tmp_path):
    tok = HFTokenizer(str(tok_dir))
    assert tok.eos_token_ids == [IM_END_ID, ENDOFTEXT_ID] and tok.eos_token_id == IM_END_ID
    assert tok.pad_token_id == PAD_ID and tok.vocab_size == VOCAB_SIZE
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    assert HFTokenizer(str(tmp_path)).eos_token_ids == [IM_END_ID]  # no generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ENDOFTEXT_ID}))
    assert HFTokenizer(str(tmp_path)).eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id='<|im_end|>'"):
        HFTokenizer(str(tmp_path))


def test_digit_tokenizer_eos_ids():
    tok = load_tokenizer(None)
    assert isinstance(tok, DigitTokenizer) and tok.eos_token_ids == [2]


def write_jsonl(path: Path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in prompts))
    return str(path)


def test_preflight_names_the_file_with_ids_outside_the_vocabulary(tok_dir, tmp_path):
    ascii_file = write_jsonl(tmp_path / "ascii.jsonl", ["abc", "def"])
    latin_file = write_jsonl(tmp_path / "latin.jsonl", ["abc", "café"])
    accented = write_jsonl(tmp_path / "accented.jsonl", ["é"])  # bytes 195, 169
    tok = HFTokenizer(str(tok_dir), chat_template=False)
    records = load_records([ascii_file, latin_file, accented])
    check_prompt_tokens(PromptStream(records, tok, 0, 64), VOCAB_SIZE, "fail")
    with pytest.raises(ConfigError, match=r"latin.jsonl:2: the prompt has token id\(s\) "
                                          r"\[169, 195\] outside the model's vocabulary of 150"):
        check_prompt_tokens(PromptStream(records, tok, 0, 64), 150, "fail")
    with pytest.raises(ConfigError, match=r"pad id\(s\) \[259\]"):
        check_prompt_tokens(PromptStream(records, tok, 0, 64), 259, "fail")
    with pytest.raises(ConfigError, match=r"EOS id\(s\) \[258\]"):
        check_prompt_tokens(PromptStream(records, tok, 0, 64), 258, "fail")
    with pytest.raises(ConfigError, match=r"latin.jsonl:1: prompt of 3 tokens exceeds"):
        check_prompt_tokens(PromptStream(records[2:], tok, 0, 2), VOCAB_SIZE, "fail")


def test_preflight_names_a_failing_template(tok_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    records = load_records([write_jsonl(tmp_path / "chat.jsonl", [[{"role": "user", "content": "hi"}]])])
    tok = HFTokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match="chat.jsonl:1: the prompt does not render .*roles must alternate"):
        check_prompt_tokens(PromptStream(records, tok, 0, 64), VOCAB_SIZE, "fail")


def test_prepare_renders_chat_prompts_for_the_model(tok_dir, tmp_path):
    """The path that crashed at the first generation: a chat-template tokenizer, chat records."""
    model = make_hf_model("llama", tmp_path / "model", tok_dir, train_steps=0)
    data = write_jsonl(tmp_path / "chat.jsonl", [CHAT, "reverse 34"])
    cfg = load_config([], [f"model.hf_config={model / 'config.json'}", f"data.tokenizer={tok_dir}",
                           f"data.train_files=[{data}]", "trainer.nproc_per_node=1", "algorithm.max_new_tokens=16"])
    prepared = prepare(cfg)
    assert prepared.tokenizer.eos_token_ids == EOS_IDS
    record = prepared.stream.records[0]
    assert prepared.stream.token_ids(record)[-1] == text_ids("\n")[0]
    assert prepared.stream.token_ids(record)[:1] == [IM_START_ID]
