"""Supervised fine-tuning examples from a user's chat data (issue 45): token ids and a loss mask
that is 1 on the assistant's tokens only, derived from the tokenizer's own chat template, never
from a hand-written one.

- **Generation markers.** A template that wraps what the assistant writes in ``{% generation %}``
  ... ``{% endgeneration %}`` (transformers' convention) gives the mask directly
  (``return_assistant_tokens_mask``).
- **Incremental rendering** otherwise. For each assistant message ``i`` the conversation is
  rendered up to message ``i`` with the generation prompt, and up to ``i`` included: the tokens
  between the two are the assistant's turn, and the mask covers them up to and including its first
  end-of-turn id (``eos_ids``; what follows it in the render, a newline, is formatting the model
  never generates). Each render must be a token prefix of the whole conversation's; a template
  that rewrites earlier turns (Qwen3 drops past reasoning) fails that check, and the row is
  refused by name (give the template generation markers, or a template of your own).

System, user and tool messages, and the generation prompt, carry no loss. A prompt/response pair
is the conversation ``[user: prompt, assistant: response]`` (a prompt given as chat messages is
those messages); with no chat template (``data.chat_template=false``, or a tokenizer without
one) it is the prompt's text followed by the response's and EOS, the loss on the latter two.

:func:`load_examples` reads a dataset's rows into examples (every row checked before any worker
starts, named by file and row); :class:`ExampleStream` deals them out in seeded epochs, and
:func:`collate` makes a batch of next-token rows.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class ExampleError(ValueError):
    """A row that cannot become an SFT example (the message says which and why)."""


@dataclass
class SFTExample:
    ids: List[int]
    mask: List[int]  # per token: 1 where the model is trained to produce it (the assistant's), else 0
    source: str = ""  # "file:row"

    def __post_init__(self):
        assert len(self.ids) == len(self.mask)

    @property
    def trained(self) -> int:
        return sum(self.mask)


def _ids(encoded) -> List[int]:
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def has_generation_markers(tok) -> bool:
    """Whether ``tok``'s chat template marks the assistant's text (``{% generation %}``)."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    return "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}").replace("  ", " ")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ExampleError("'messages' must be a non-empty list of {role, content} messages")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise ExampleError(f"message {k} has role {m.get('role') if isinstance(m, Mapping) else m!r}; "
                               f"roles are {list(ROLES)}")
        if m.get("content") is None and not m.get("tool_calls"):
            raise ExampleError(f"message {k} ({m['role']}) has no content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ExampleError("no assistant message: nothing to train on")


def chat_example(tok, messages: Sequence[Mapping[str, Any]], eos_ids: Sequence[int],
                 tools: Optional[List[dict]] = None, template_kwargs: Optional[Dict[str, Any]] = None) -> SFTExample:
    """The ids of the whole conversation through ``tok``'s chat template and the assistant mask."""
    check_messages(messages)
    kwargs = dict(template_kwargs or {}, tools=tools)
    messages = list(messages)
    if has_generation_markers(tok):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      **kwargs)
        ids, mask = _ids(out), [int(b) for b in out["assistant_masks"]]
        if not any(mask):
            raise ExampleError("the template's generation markers cover no token")
        return SFTExample(ids, mask)
    whole = _ids(tok.apply_chat_template(messages, tokenize=True, **kwargs))
    mask = [0] * len(whole)
    eos = set(eos_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _ids(tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True, **kwargs)) \
            if i else []
        upto = _ids(tok.apply_chat_template(messages[:i + 1], tokenize=True, **kwargs))
        if whole[:len(upto)] != upto or upto[:len(start)] != start:
            raise ExampleError(f"the chat template renders message {i} (assistant) differently once later messages "
                               f"follow (it rewrites earlier turns): give it {{% generation %}} markers "
                               f"(data.chat_template_path) so the assistant's tokens are marked")
        end = len(upto)
        for j in range(len(start), len(upto)):
            if upto[j] in eos:
                end = j + 1
                break
        mask[len(start):end] = [1] * (end - len(start))
    if not any(mask):
        raise ExampleError("the assistant messages render to no token")
    return SFTExample(whole, mask)


def pair_example(tok, prompt: str, response: str, eos_ids: Sequence[int], **kwargs) -> SFTExample:
    """A prompt/response pair as the conversation [user: prompt, assistant: response]."""
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ExampleError("a prompt/response row needs two strings")
    return chat_example(tok, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                        eos_ids, **kwargs)


def plain_pair_example(tok, prompt: str, response: str, eos_id: int) -> SFTExample:
    """A prompt/response pair without a chat template: the prompt's tokens (with whatever special
    tokens the tokenizer adds), then the response's and EOS, trained."""
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ExampleError("a prompt/response row needs two strings without a chat template")
    head = _ids(tok.encode(prompt))
    tail = _ids(tok.encode(response, add_special_tokens=False)) + [eos_id]
    return SFTExample(head + tail, [0] * len(head) + [1] * len(tail))


def fit(example: SFTExample, max_length: int, truncate: bool) -> SFTExample:
    """At most ``max_length`` tokens: cut on the right (``truncate``; a row left with no trained
    token is refused), else a longer row is refused by its length."""
    if len(example.ids) <= max_length:
        return example
    if not truncate:
        raise ExampleError(f"{len(example.ids)} tokens > data.max_length={max_length}")
    cut = SFTExample(example.ids[:max_length], example.mask[:max_length], example.source)
    if not cut.trained:
        raise ExampleError(f"no assistant token within data.max_length={max_length} ({len(example.ids)} tokens)")
    return cut


def _row_example(row: Any, data, tok) -> SFTExample:
    """One dataset row (``data``: DataConfig; ``tok``: megarl.data.tokenizer.HFTokenizer)."""
    if not isinstance(row, Mapping):
        raise ExampleError("is not a JSON object")
    chat = tok.chat_template
    kwargs = {"template_kwargs": tok.template_kwargs}
    tools = row.get("tools")
    if isinstance(tools, str):  # parquet keeps nested schemas as JSON text
        tools = json.loads(tools) if tools.strip() else None
    if tools:
        kwargs["tools"] = tools
    if data.messages_key in row:
        if not chat:
            raise ExampleError(f"'{data.messages_key}' rows need a chat template: the tokenizer {tok.path} has none "
                               f"(give one with data.chat_template_path) or data.chat_template is false")
        messages = list(row[data.messages_key] or [])
    elif data.prompt_key in row and data.response_key in row:
        prompt, response = row[data.prompt_key], row[data.response_key]
        if not chat:
            return plain_pair_example(tok.tok, prompt, response, tok.eos_token_id)
        if not isinstance(response, str):
            raise ExampleError(f"'{data.response_key}' must be a string")
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        messages = head + [{"role": "assistant", "content": response}]
    else:
        raise ExampleError(f"has neither '{data.messages_key}' (data.messages_key) nor '{data.prompt_key}' and "
                           f"'{data.response_key}' (data.prompt_key, data.response_key); fields: {sorted(row)}")
    if tok.system_prompt is not None and not (messages and isinstance(messages[0], Mapping)
                                              and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": tok.system_prompt}] + messages
    return chat_example(tok.tok, messages, tok.eos_token_ids, **kwargs)


def _pair_examples(row: Any, data, tok) -> List[SFTExample]:
    """A preference row: its prompt with the chosen and with the rejected response (strings: one
    assistant message each; lists of messages: whole conversations), as two examples."""
    if not isinstance(row, Mapping):
        raise ExampleError("is not a JSON object")
    missing = [k for k in (data.chosen_key, data.rejected_key) if k not in row]
    if missing:
        raise ExampleError(f"has no {' and no '.join(repr(k) for k in missing)} (data.chosen_key, "
                           f"data.rejected_key); fields: {sorted(row)}")
    out = []
    for key in (data.chosen_key, data.rejected_key):
        response = row[key]
        if isinstance(response, (list, tuple)):  # a whole conversation
            one = {data.messages_key: response, "tools": row.get("tools")}
        else:
            if data.prompt_key not in row:
                raise ExampleError(f"has no '{data.prompt_key}' (data.prompt_key) for its '{key}' response")
            one = {data.prompt_key: row[data.prompt_key], data.response_key: response, "tools": row.get("tools")}
        out.append(_row_example(one, data, tok))
    return out


def load_examples(files: Sequence[str], data, tok, max_length: int, key: str = "data.train_files") -> List[SFTExample]:
    """Every row of ``files`` (jsonl, parquet, globs, HF datasets directories) as an example of at
    most ``max_length`` tokens. ``data.truncation``: ``right`` cuts a longer row, ``skip`` drops
    it, ``error`` refuses it; ``data.bad_rows=skip`` drops (and logs) any row that fails, else the
    first stops the command, named by file and row."""
    return [e for (e,) in _load(files, data, tok, max_length, key, lambda row: [_row_example(row, data, tok)])]


def load_pairs(files: Sequence[str], data, tok, max_length: int,
               key: str = "data.train_files") -> List[Tuple[SFTExample, SFTExample]]:
    """Every preference row of ``files`` as a (chosen, rejected) pair of examples (``megarl
    train-rm``): the rows' ``data.prompt_key``, ``data.chosen_key`` and ``data.rejected_key``;
    lengths, truncation and bad rows as :func:`load_examples`."""
    return [tuple(pair) for pair in _load(files, data, tok, max_length, key, lambda row: _pair_examples(row, data, tok))]


def _load(files, data, tok, max_length: int, key: str, examples_of) -> List[List[SFTExample]]:
    from megarl.config.schema import BadRows, Truncation
    from megarl.data.datasets import DataError, expand_files, rows_of

    out: List[List[SFTExample]] = []
    dropped = 0
    for path in expand_files(files, key):
        for number, row in rows_of(path):
            where = f"{path}:{number}"
            try:
                if isinstance(row, DataError):
                    raise ExampleError(str(row))
                examples = examples_of(row)
                if any(len(e.ids) > max_length for e in examples) and data.truncation == Truncation.skip:
                    dropped += 1
                    continue
                examples = [fit(e, max_length, data.truncation == Truncation.right) for e in examples]
            except (ExampleError, ValueError, TypeError, KeyError) as err:
                if data.bad_rows == BadRows.fail:
                    hint = ("data.truncation=right or skip, or a larger data.max_length"
                            if "data.max_length" in str(err) else "data.bad_rows=skip to skip such rows")
                    raise DataError(f"{where} {err} ({key}; set {hint})") from None
                log.warning("skipping %s: %s", where, err)
                dropped += 1
                continue
            for e in examples:
                e.source = where
            out.append(examples)
    if dropped:
        log.warning("%s: %d row(s) dropped", key, dropped)
    if not out:
        raise DataError(f"{key}: no usable rows in {list(files)}")
    return out


def collate(examples: Sequence[SFTExample], pad_id: int, rows: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Next-token rows, right-padded to the longest: ``tokens`` (ids[:-1]), ``labels`` (ids[1:]),
    ``loss_mask`` (the label's mask) and ``position_ids``; ``rows`` pads the batch with empty rows
    (no trained token) up to that many (a last validation batch, for the ranks to split)."""
    rows = rows or len(examples)
    seq = max(len(e.ids) for e in examples) - 1
    tokens = torch.full((rows, seq), pad_id, dtype=torch.long)
    labels = torch.full((rows, seq), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, seq)
    for i, e in enumerate(examples):
        n = len(e.ids) - 1
        tokens[i, :n] = torch.tensor(e.ids[:-1])
        labels[i, :n] = torch.tensor(e.ids[1:])
        mask[i, :n] = torch.tensor(e.mask[1:], dtype=torch.float)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask,
            "position_ids": torch.arange(seq).expand(rows, -1).contiguous()}


def collate_scored(examples: Sequence[SFTExample], pad_id: int, rows: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Whole sequences for a value head (``megarl train-rm``), right-padded: ``tokens`` (every id),
    ``position_ids``, and ``loss_mask`` 1 at each row's last token alone, where the row is scored
    (transformers' ``*ForSequenceClassification`` scores its last non-pad token); ``labels`` unused.
    ``rows``: empty rows (scored nowhere) up to that many."""
    rows = rows or len(examples)
    seq = max(len(e.ids) for e in examples)
    tokens = torch.full((rows, seq), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, seq)
    for i, e in enumerate(examples):
        tokens[i, :len(e.ids)] = torch.tensor(e.ids)
        mask[i, len(e.ids) - 1] = 1.0
    return {"tokens": tokens, "labels": torch.zeros_like(tokens), "loss_mask": mask,
            "position_ids": torch.arange(seq).expand(rows, -1).contiguous()}


class ExampleStream:
    """The training examples in epochs, each a permutation drawn from ``seed`` and the epoch (in
    file order with ``shuffle`` false); its position is part of a checkpoint."""

    def __init__(self, examples: Sequence[SFTExample], seed: int, shuffle: bool = True):
        self.examples, self.seed, self.shuffle = list(examples), seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._draw()

    def _draw(self) -> List[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> List[SFTExample]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._draw()
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: Mapping[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._draw()
