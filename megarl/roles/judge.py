"""A generative reward model's engine (an LLM judge, ``reward_model.generative``) on the training
ranks: a rollout backend's engine (``reward_model.engine``) in the generation layout, fed from the
judge's frozen weights in the training layout by the same in-process resharder as the policy's
rollout, and asleep between calls (its weights and KV cache given back while the trainer runs).
The driver's side (template, parser, deadline) is megarl.rewards.judge."""

from __future__ import annotations

from typing import List, Sequence

from megarl.protocol import Dispatch, verb
from megarl.rollout.types import Response, RolloutEngine, SamplingParams


class Judge:
    """Judgements for the driver; every verb is collective over the world."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    @verb(Dispatch.ALL)
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        """Wake the engine, fill it from the judge's weights, judge ``prompts``, put it back to sleep."""
        self.engine.resume_memory()
        try:
            self.engine.update_weights(0)
            self.engine.resume_kv_cache()
            return self.engine.generate(prompts, sampling)
        finally:
            self.engine.release_memory()
