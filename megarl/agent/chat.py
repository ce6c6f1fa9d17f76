"""Token ids of an episode's prompt and of each observation, without re-tokenizing the transcript.

With an HF chat template, an observation becomes the tokens the template adds for a ``tool``
message after the assistant's turn (and the next assistant prompt): the difference of two
renders of a fixed conversation, so the policy's own tokens are never re-encoded. Without a chat
template (the digit tokenizer, ``data.chat_template=false``), the observation text is encoded as
it is; the environment writes whatever separators its format needs (the digit tokenizer drops
the characters it lacks, e.g. an error message's letters: an observation is context, not a target).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Union

from megarl.data.tokenizer import HFTokenizer

log = logging.getLogger(__name__)

# Stand-in contents of the fixed conversation the tool turn is cut from; no template alters them.
_USER, _ASSISTANT = "MEGARL_USER_TURN", "MEGARL_ASSISTANT_TURN"


def with_extra(prompt: Union[str, List[dict]], extra: Optional[str]) -> Union[str, List[dict]]:
    """The record's prompt with an environment's ``reset`` text appended to its first user message
    (a string prompt is one user message)."""
    if not extra:
        return prompt
    if isinstance(prompt, str):
        return prompt + extra
    messages = [dict(m) for m in prompt]
    for m in messages:
        if m.get("role") == "user":
            m["content"] = m["content"] + extra
            return messages
    raise ValueError("the environment's reset text goes into the first user message, but the prompt has none")


class ChatCodec:
    """Prompt and observation token ids for one tokenizer (built once per run)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.warned = False
        self.template = isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template
        if self.template:
            base = self._render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}])
            if base.count(_ASSISTANT) != 1:
                raise ValueError("the chat template does not render an assistant message's content once; "
                                 "multi-turn rollouts cannot place the observations")
            self.base = base
            # what the template writes after an assistant's content (Qwen: "<|im_end|>\n")
            self.closing = base[base.index(_ASSISTANT) + len(_ASSISTANT):]

    def _render(self, messages: List[dict], tools=None, generation_prompt: bool = False) -> str:
        return self.tokenizer.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)

    def prompt_ids(self, prompt: Union[str, List[dict]], tools: Sequence[Dict[str, Any]] = (),
                   extra: Optional[str] = None) -> List[int]:
        """The first context of an episode: the record's prompt with the reset text, and the
        environment's tools rendered by the chat template (ignored without one)."""
        prompt = with_extra(prompt, extra)
        if not (self.template and tools):
            return self.tokenizer.prompt_ids(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = self.tokenizer.tok.apply_chat_template(messages, tools=list(tools), add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def observation_ids(self, observation: str, last_token: Optional[int]) -> List[int]:
        """Tokens that follow a policy turn ending with ``last_token`` to give it ``observation``:
        the rest of the template's end of the assistant turn (what the policy's stop token did not
        already write), the tool message, and the next assistant prompt."""
        if not self.template:
            tok = self.tokenizer
            if isinstance(tok, HFTokenizer):
                return tok.tok.encode(observation, add_special_tokens=False)
            kept = "".join(c for c in observation if c in tok.ids)
            if len(kept) < len(observation) and not self.warned:  # e.g. the letters of an error message
                log.warning("observation %r: characters outside the built-in tokenizer are dropped", observation)
                self.warned = True
            return tok.encode(kept)
        turn = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        full = self._render(turn + [{"role": "tool", "content": observation}], generation_prompt=True)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders the earlier turns differently once a tool message "
                             "follows; multi-turn rollouts need a template that only appends")
        closing = self.closing
        if last_token is not None:
            generated = self.tokenizer.tok.decode([last_token], skip_special_tokens=False)
            if generated and closing.startswith(generated):
                closing = closing[len(generated):]
        return self.tokenizer.tok.encode(closing + full[len(self.base):], add_special_tokens=False)
