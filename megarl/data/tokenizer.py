"""Tokenizers: a built-in character tokenizer for the demo (no hub), or an HF tokenizer with
its chat template."""

from __future__ import annotations

from typing import List, Optional, Sequence


class DigitTokenizer:
    """Digits, a few symbols and specials, one character per token (the built-in tasks)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789=+-*/() ,|"

    def __init__(self):
        self.vocab = list(self.SPECIALS) + list(self.CHARS)
        self.ids = {c: i for i, c in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2

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


class HFTokenizer:
    """An HF tokenizer; chat-formatted prompts (a list of messages) go through its chat template."""

    def __init__(self, path: str, chat_template: bool = True):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.chat_template = chat_template and self.tok.chat_template is not None
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(self.tok)

    def prompt_ids(self, prompt) -> List[int]:
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if self.chat_template:
            return list(self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        return self.tok.encode("\n".join(m["content"] for m in prompt))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: Optional[str], chat_template: bool = True):
    """``data.tokenizer``: null = the built-in digit tokenizer, else an HF tokenizer directory."""
    return DigitTokenizer() if not path else HFTokenizer(path, chat_template)
