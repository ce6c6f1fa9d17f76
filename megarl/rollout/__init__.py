"""Rollout: one interface (``types.RolloutEngine``), a native Megatron engine that runs
everywhere, and SGLang for GPU clusters (optional extra ``sglang``)."""

from megarl.rollout.types import Response, RolloutEngine, RolloutStats, SamplingParams, stack_log_probs

__all__ = ["Response", "RolloutEngine", "RolloutStats", "SamplingParams", "stack_log_probs"]
