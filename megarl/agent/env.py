"""The environment interface of multi-turn rollouts.

An episode is one sample: the environment is reset with the sample's dataset record, then each
model turn (the decoded text of the tokens the policy generated in that turn) goes to
:meth:`Environment.step`, which answers with an observation (appended to the context as the
tool's message), a reward and whether the episode is over. The agent loop
(:mod:`megarl.agent.loop`) owns tokens, budgets and batching; an environment sees only text.

Both calls are coroutines so that an environment behind a network endpoint waits without
holding a thread; a local environment whose work blocks (a subprocess, a computation) runs it
with ``asyncio.to_thread``. The loop runs many episodes at once on one event loop: a step must
never block it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megarl.data.datasets import PromptRecord


@dataclass
class StepResult:
    observation: str = ""
    """Text given back to the model as the tool's message ("" with ``done``: nothing to append)."""
    reward: float = 0.0
    """This step's reward; an episode's reward is the sum over its steps (see the loop's config)."""
    done: bool = False
    """The episode is over: the model gets no further turn."""
    info: Dict[str, Any] = field(default_factory=dict)
    """Per-step facts for metrics, e.g. ``tool_error`` (a malformed or failed call: bool),
    ``tool`` (the tool's name), ``tool_seconds``."""


class Environment(abc.ABC):
    """One episode's environment. A new instance (or a :meth:`reset`) per sample; instances of
    concurrent episodes must not share mutable state."""

    tools: List[Dict[str, Any]] = []
    """The tools offered to the model, as JSON-schema function definitions
    (``{"type": "function", "function": {"name", "description", "parameters"}}``), rendered into
    the prompt by the tokenizer's chat template. Empty: the prompt names no tools."""

    @abc.abstractmethod
    async def reset(self, record: PromptRecord) -> Optional[str]:
        """Start the episode of ``record``; may return extra text for the first user message
        (None: the record's prompt as it is)."""

    @abc.abstractmethod
    async def step(self, message: str) -> StepResult:
        """The model's turn ``message`` (its decoded text, tool call included); the answer."""

    async def close(self) -> None:
        """Release what the episode holds (a sandbox directory, a connection). Always called."""
