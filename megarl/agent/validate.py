"""The ``rollout:`` section of ``megarl train`` (multi-turn episodes) against the rest of the
run's config, checked before any process starts."""

from __future__ import annotations

import logging

from megarl.agent.envs import check_sandbox, env_factory
from megarl.agent.loop import check_config as check_agent_config, total_budget
from megarl.algorithms.presets import preset
from megarl.config import ConfigError
from megarl.config.schema import REWARD_MODEL, EpisodeReward, RolloutConfig

log = logging.getLogger(__name__)


def check_agent(cfg, args) -> bool:
    """The ``rollout:`` section (multi-turn episodes) and what it cannot combine with; True when
    ``rollout.env`` is set."""
    r, algo = cfg.rollout, cfg.algorithm
    if r.env is None:
        if r != RolloutConfig():
            log.warning("rollout.* is set but rollout.env is null: the run is single-turn and ignores it")
        return False
    try:
        check_agent_config(r, algo.max_new_tokens)
        env_factory(r.env, r.max_tool_seconds, sandbox=r.sandbox)  # imports and checks the environment
        check_sandbox(r.env, r.sandbox)  # one confined call: can this machine hide the host from the tool?
    except ValueError as err:
        raise ConfigError(str(err)) from None
    budget = total_budget(r, algo.max_new_tokens)
    if budget >= args.max_position_embeddings:
        raise ConfigError(f"rollout.max_total_tokens={budget} (null: max_turns x algorithm.max_new_tokens) leaves no "
                          f"room for prompts in the model's {args.max_position_embeddings} positions; lower it")
    if algo.routing_replay:
        # the native engine records the routing of each call's tokens; a multi-turn sample spans
        # several calls (each re-reads the earlier turns), so no single record replays them all
        raise ConfigError("algorithm.routing_replay=true does not support multi-turn rollouts (rollout.env); "
                          "set algorithm.routing_replay=false or rollout.env=null")
    if preset(algo).greedy_baseline:
        raise ConfigError(f"algorithm.name={algo.name}: the greedy baseline is a single-turn response; with "
                          f"rollout.env use another estimator (e.g. grpo, rloo)")
    if r.reward == EpisodeReward.verifier and algo.reward_fn == REWARD_MODEL:
        raise ConfigError("rollout.reward=verifier scores the final turn with algorithm.reward_fn; the reward "
                          "model (reward_fn=model) reads whole sequences: use a verifier or rollout.reward=env")
    return True
