"""Tokenizers: a built-in character tokenizer for the demo (no hub), or an HF tokenizer with
its chat template, pad id and every EOS id of the model's generation config."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger(__name__)


class DigitTokenizer:
    """Digits, a few symbols and specials, one character per token (the built-in tasks)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789=+-*/() ,|"

    def __init__(self):
        self.vocab = list(self.SPECIALS) + list(self.CHARS)
        self.ids = {c: i for i, c in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.eos_token_ids = [self.eos_token_id]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> List[int]:
        missing = sorted({c for c in text if c not in self.ids})
        if missing:
            raise ValueError(f"characters {missing} are not in the built-in tokenizer ({self.CHARS!r})")
        return [self.ids[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(self.SPECIALS) and i < len(self.vocab))

    def prompt_ids(self, prompt) -> List[int]:
        return [self.bos_token_id] + self.encode(prompt if isinstance(prompt, str) else prompt[-1]["content"])


def generation_eos_ids(directory: Path) -> List[int]:
    """``eos_token_id`` of ``directory/generation_config.json`` (an int or a list), [] if none."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{path} is not a JSON object: {err}") from None
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id={value!r} must be an int or a list of ints")
    return ids


class HFTokenizer:
    """An HF tokenizer. Prompts given as chat messages (a list of {role, content}) go through its
    chat template, a plain string as one user message; without a template (or with
    ``chat_template=False``) text is encoded plainly, with whatever special tokens (BOS) the
    tokenizer's post-processor adds, chat messages joined by newlines.

    ``eos_token_ids``: the tokenizer's eos plus every ``eos_token_id`` of the directory's
    generation_config.json (Qwen-style models end a turn with <|im_end|> and a document with
    <|endoftext|>; generation stops on any). ``pad_token_id``: the tokenizer's pad token, else its
    first EOS id (pads only fill the right end of a batch, behind the loss mask).

    ``system_prompt`` goes before every prompt that has no system message (a line before the text
    without a template); ``template_kwargs`` are the chat template's own arguments (Qwen3's
    ``enable_thinking``); ``template_path`` is a Jinja file used instead of the tokenizer's template.
    """

    def __init__(self, path: str, chat_template: bool = True, system_prompt: Optional[str] = None,
                 template_kwargs: Optional[Dict[str, Any]] = None, template_path: Optional[str] = None):
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path)
        if template_path:
            file = Path(template_path)
            if not file.is_file():
                raise FileNotFoundError(f"data.chat_template_path={template_path}: no such file")
            self.tok.chat_template = file.read_text()
        self.chat_template = chat_template and self.tok.chat_template is not None
        self.system_prompt, self.template_kwargs = system_prompt, dict(template_kwargs or {})
        # chat messages without a template are joined by newlines: said once (data.chat_template=false: chosen)
        self.warn_no_template = chat_template
        eos = [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]
        directory = Path(path)
        from_generation = generation_eos_ids(directory) if directory.is_dir() else []
        self.eos_token_ids = list(dict.fromkeys(eos + from_generation))
        if not self.eos_token_ids:
            raise ValueError(f"tokenizer {path} has no eos token and no generation_config.json eos_token_id: "
                             f"generation could not stop")
        self.eos_token_id = self.eos_token_ids[0]
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(self.tok)

    def prompt_ids(self, prompt) -> List[int]:
        if self.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if self.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
                messages = [{"role": "system", "content": self.system_prompt}] + messages
            # return_dict=False: transformers 5 returns a BatchEncoding by default (transformers 4
            # a list); both accept the argument. The template holds its own special tokens.
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, **self.template_kwargs)
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        if not isinstance(prompt, str) and self.warn_no_template:
            self.warn_no_template = False
            log.warning("tokenizer %s has no chat template: chat-message prompts are joined by newlines, with no "
                        "role markers; give a template with data.chat_template_path=FILE.jinja (or set "
                        "data.chat_template=false to join them so without this warning)", self.path)
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        if self.system_prompt is not None:
            text = f"{self.system_prompt}\n{text}"
        return self.tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: Optional[str], chat_template: bool = True, system_prompt: Optional[str] = None,
                   template_kwargs: Optional[Dict[str, Any]] = None, template_path: Optional[str] = None):
    """``data.tokenizer``: null = the built-in digit tokenizer, else an HF tokenizer directory
    (with ``data.system_prompt``, ``data.chat_template_kwargs`` and ``data.chat_template_path``)."""
    if not path:
        given = [k for k, v in (("data.system_prompt", system_prompt), ("data.chat_template_kwargs", template_kwargs),
                                ("data.chat_template_path", template_path)) if v]
        if given:
            raise ValueError(f"{', '.join(given)}: the built-in digit tokenizer has no chat template or text; "
                             f"set data.tokenizer (or model.path) to an HF tokenizer")
        return DigitTokenizer()
    return HFTokenizer(path, chat_template, system_prompt, template_kwargs, template_path)


def check_vocab(tokens: int, model_vocab: int, reward_model_vocab: Optional[int] = None) -> None:
    """The tokenizer's ``tokens`` against the model's vocabulary and, with a reward model (which
    reads the policy's token ids), against the reward model's."""
    from megarl.config import ConfigError

    if tokens > model_vocab:
        raise ConfigError(f"the tokenizer has {tokens} tokens, the model's vocab_size is "
                          f"{model_vocab} (model.hf_config)")
    if reward_model_vocab is not None and tokens > reward_model_vocab:
        raise ConfigError(f"the reward model's vocab_size is {reward_model_vocab} but the policy's tokenizer has "
                          f"{tokens} tokens: the reward model reads the policy's token ids, so "
                          f"it needs the policy's tokenizer (reward_model.path / reward_model.hf_config)")
