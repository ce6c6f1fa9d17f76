"""Rewards: rule-based verifiers, user functions by import path, safe scoring of a batch."""

from megarl.rewards.registry import REWARD_FUNCTIONS, resolve_reward_fn
from megarl.rewards.runner import ScoreReport, score_all

__all__ = ["REWARD_FUNCTIONS", "ScoreReport", "resolve_reward_fn", "score_all"]
