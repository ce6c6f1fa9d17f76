"""Rewards: rule-based verifiers, user functions by import path, safe scoring of a batch in
worker processes."""

from megarl.rewards.runner import RewardPool, RewardSample, ScoreReport

__all__ = ["REWARD_FUNCTIONS", "RewardPool", "RewardSample", "ScoreReport", "resolve_reward_fn", "reward_fn_path"]


def __getattr__(name: str):
    # The registry imports megarl.algorithms (and so torch); a reward worker process imports this
    # package too and must start in milliseconds, so the registry loads on first use.
    if name in ("REWARD_FUNCTIONS", "resolve_reward_fn", "reward_fn_path"):
        from megarl.rewards import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'megarl.rewards' has no attribute '{name}'")
