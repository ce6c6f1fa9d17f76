"""Multi-turn RL end to end through ``megarl train`` on CPU: actor t=2 → rollout t_g=1, an
environment that answers every turn, GRPO on the episode rewards. The trainer's log-probs of the
multi-turn samples equal the rollout's (the first PPO ratio is 1) and the observation tokens
were in the samples, out of the loss. Invalid ``rollout:`` settings fail before any worker."""

from __future__ import annotations

import pytest

from megarl.agent.env import Environment, StepResult
from megarl.config import ConfigError, load_config
from megarl.entrypoints.train_rl import prepare, run
from tests import ray_cluster

DEMO = "configs/grpo_demo.yaml"
ENV = "tests.e2e.test_agent:ThreeTurnEnv"


class ThreeTurnEnv(Environment):
    """Answers each turn with "|<turn>|" for three turns; reward 1 per turn that wrote a 7."""

    async def reset(self, record):
        self.turn = 0
        return None

    async def step(self, message):
        self.turn += 1
        return StepResult(f"|{self.turn}|", reward=float("7" in message), done=self.turn == 3,
                          info={"tool": "echo"})


# vLLM's CPU attention takes head_dim >= 32: the demo's model with two heads of 32
ENGINES = {"native": [], "vllm": ["parallel.rollout.engine=vllm", "model.hf_config=configs/models/tiny-digits-hd32.json"]}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_multi_turn_log_prob_parity_and_masks(tmp_path, engine):
    """The multi-turn agent loop on every rollout backend that generates here."""
    cfg = load_config([DEMO], [f"trainer.run_dir={tmp_path}", "logging.progress_bar=false", "logging.backends=[console]",
                               "trainer.train_steps=2", "data.prompts_per_step=4", "algorithm.samples_per_prompt=4",
                               f"rollout.env={ENV}", "rollout.max_turns=3", "rollout.max_total_tokens=20",
                               *ENGINES[engine], *ray_cluster.overrides()])
    rows = run(prepare(cfg))
    first = rows[0]
    assert first["rollout/logp_max_abs_diff"] <= 1e-5  # multi-turn rollout log-probs == trainer's
    assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for r in rows:
        assert r["agent/turns_max"] <= 3 and r["agent/turns_mean"] > 1
        assert r["agent/observation_tokens_mean"] > 0  # observations were in the samples ...
        assert 0 < r["agent/observation_token_frac"] < 1
        assert r["response/length_max"] <= 20 and r["agent/generate_calls"] >= 2 and r["time/tool_s"] >= 0
        assert r["agent/tool_calls_mean"] == pytest.approx(r["agent/turns_mean"])


@pytest.mark.parametrize("overrides, field", [
    (["rollout.env=no_such_env"], "rollout.env"),
    ([f"rollout.env={ENV}", "rollout.reward=final"], "rollout.reward='final'"),
    ([f"rollout.env={ENV}", "rollout.max_total_tokens=300"], "rollout.max_total_tokens=300"),
    ([f"rollout.env={ENV}", "algorithm.name=remax"], "greedy baseline"),
    ([f"rollout.env={ENV}", "rollout.max_turns=0"], "rollout.max_turns"),
])
def test_invalid_rollout_settings_fail_before_workers(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(".", r"\.")):
        prepare(load_config([DEMO], overrides))
