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
is the conversation ``[user: prompt, assistant: response]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

ROLES = ("system", "user", "assistant", "tool")


class ExampleError(ValueError):
    """A row that cannot become an SFT example (the message says which and why)."""


@dataclass
class SFTExample:
    ids: List[int]
    mask: List[int]  # per token: 1 where the model is trained to produce it (the assistant's), else 0

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


def fit(example: SFTExample, max_length: int, truncate: bool) -> SFTExample:
    """At most ``max_length`` tokens: cut on the right (``truncate``; a row left with no trained
    token is refused), else a longer row is refused by its length."""
    if len(example.ids) <= max_length:
        return example
    if not truncate:
        raise ExampleError(f"{len(example.ids)} tokens > data.max_length={max_length}")
    cut = SFTExample(example.ids[:max_length], example.mask[:max_length])
    if not cut.trained:
        raise ExampleError(f"no assistant token within data.max_length={max_length} ({len(example.ids)} tokens)")
    return cut
