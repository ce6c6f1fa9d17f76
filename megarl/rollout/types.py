"""The rollout interface every engine implements, and what goes in and out of it."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class SamplingParams:
    """How responses are drawn."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy. Log-probs are reported at this temperature (1 when greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    n: int = 1
    """Samples per prompt."""
    max_new_tokens: int = 32
    """Response length limit (tokens); reaching it ends a response with finish reason 'length'."""
    stop_token_ids: Sequence[int] = ()
    """Tokens that end a response (kept as its last token; finish reason 'stop')."""
    seed: Optional[int] = None
    """Seed of the draws; each sample's stream depends only on (seed, prompt index, sample index)."""
    prompt_seeds: Optional[Sequence[int]] = None
    """Per prompt, a seed that replaces (seed, prompt index) in naming its samples' streams, so
    that a prompt's draws do not depend on which other prompts share the call (the agent loop
    batches whichever episodes wait for a turn); None = (seed, prompt index)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0 or self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0, n={self.n} and "
                             f"max_new_tokens={self.max_new_tokens} >= 1")

    def stream_key(self, seed: int, prompt_index: int) -> Tuple[int, int]:
        """(seed, prompt) that, with the sample index, name one sample's random stream."""
        return (seed, prompt_index) if self.prompt_seeds is None else (self.prompt_seeds[prompt_index], -1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


@dataclass
class Response:
    """One sampled response."""

    prompt_index: int
    sample_index: int
    token_ids: List[int]
    log_probs: List[float]  # of each response token, at the sampling temperature, full vocabulary
    finish_reason: str  # "stop" or "length"
    policy_version: int = -1
    # [prompt + response tokens - 1, moe_layers, topk] int: the experts each fed token was routed
    # to, in the trainer's input positions (the last response token is never fed); MoE models
    # with routing recorded only (routing replay), else None.
    routing: Optional[torch.Tensor] = None
    # Multi-turn episodes (megarl.agent.loop): 1 where the policy generated the token, 0 where an
    # environment's observation put it (no loss, log-prob 0); None = every token is the policy's.
    policy_mask: Optional[List[int]] = None
    # The episode's own prompt where its environment changed the record's (tools in the chat
    # template, text from ``reset``); None = the record's prompt ids.
    prompt_ids: Optional[List[int]] = None
    # The policy version that sampled each token, where a partial rollout's weights changed
    # mid-response; None = every token is ``policy_version``'s.
    versions: Optional[List[int]] = None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_versions(self) -> List[int]:
        """The policy version of each response token."""
        return list(self.versions) if self.versions is not None else [self.policy_version] * self.length


@dataclass
class RolloutStats:
    """What the last ``generate`` cost."""

    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class RolloutEngine(abc.ABC):
    """Generation for the RL loop. Collective: every rank of the world calls each verb."""

    policy_version: int = -1

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        """Responses for every prompt (``n`` each, prompt-major), the same list on every rank."""

    def begin(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        """Start a rollout that :meth:`advance` drives, with weight updates allowed between its
        calls (a partial rollout). Engines that cannot pause generate it whole at the first
        :meth:`advance`."""
        self._pending = (list(prompts), sampling)

    def admit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, first_index: int) -> None:
        """Add prompts to the rollout in flight (sample-level streaming, ``trainer.loop=async``), their
        responses' ``prompt_index`` counting from ``first_index``. Engines that decode one batch at a
        time refuse."""
        raise NotImplementedError(f"{type(self).__name__} cannot add requests to a rollout in flight "
                                  f"(trainer.loop=async); use parallel.rollout.engine=native")

    def advance(self, max_tokens: Optional[int] = None) -> List[Response]:
        """Up to ``max_tokens`` more tokens of each unfinished response (None: to the end); the
        responses that ended in this call."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            raise RuntimeError("no rollout in flight: call begin() first")
        return self.generate(*pending)

    def in_flight(self) -> int:
        """Responses begun and not yet returned by :meth:`advance`."""
        pending = getattr(self, "_pending", None)
        return 0 if pending is None else len(pending[0]) * pending[1].n

    @abc.abstractmethod
    def update_weights(self, policy_version: int) -> None:
        """Take the actor's current weights through the hybrid engine."""

    def sync_stats(self):
        """What the last :meth:`update_weights` did on this rank (a ``megarl.hybrid.SyncStats``)."""
        return self.resharder.last

    def release_memory(self) -> None:
        """Give weights and KV cache memory back while training runs."""

    def resume_memory(self) -> None:
        """Take the weights' memory back before the next weight sync."""

    def resume_kv_cache(self) -> None:
        """Take the generation-only memory (KV cache) back, once the trainer has offloaded its
        states after the sync; engines whose KV cache lives within ``generate`` do nothing."""

    def flush_cache(self) -> None:
        """Drop cached prefixes (stale after a weight update)."""


def dp_rows(prompts: int, n: int, dp: int, dp_rank: int) -> Tuple[List[Tuple[int, int]], int]:
    """The (prompt, sample) rows a generation data-parallel replica decodes: a contiguous share of
    the prompt-major rows, ceil(rows / dp) each (the last replicas may get fewer, or none); and
    that share."""
    rows = [(p, s) for p in range(prompts) for s in range(n)]
    share = -(-len(rows) // dp)
    return rows[dp_rank * share:(dp_rank + 1) * share], share


def gather_responses(mine: Sequence[Response]) -> List[Response]:
    """Every rank's responses, on every rank, once each, prompt-major (collective over the world;
    the ranks of one generation replica report the same rows: kept once)."""
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(mine))
    seen, merged = set(), []
    for part in parts:
        for r in part:
            if (r.prompt_index, r.sample_index) not in seen:
                seen.add((r.prompt_index, r.sample_index))
                merged.append(r)
    merged.sort(key=lambda r: (r.prompt_index, r.sample_index))
    return merged


def row_seeds(rows: Sequence[Tuple[int, int]], sampling: SamplingParams) -> List[int]:
    """A seed for each (prompt, sample) row, for engines that seed each request alone (SGLang,
    vLLM): the samples of a prompt must differ, and a row's seed depends only on its stream key
    (:meth:`SamplingParams.stream_key`) and sample index."""
    keys = [(sampling.stream_key(sampling.seed or 0, p), s) for p, s in rows]
    return [(seed * 1_000_003 + p * 7_919 + s) % (1 << 31) for (seed, p), s in keys]


def stack_log_probs(responses: Sequence[Response]) -> torch.Tensor:
    """[rows, max_len] log-probs of responses, zero past each length."""
    width = max((r.length for r in responses), default=0)
    out = torch.zeros(len(responses), width)
    for i, r in enumerate(responses):
        out[i, : r.length] = torch.tensor(r.log_probs)
    return out
