"""Algorithms as data: what ``algorithm.name`` means, in one table, validated in one place.

A preset names the advantage estimator and says what the loop must provide around it (a critic,
groups of samples per prompt, a greedy baseline) and the defaults of the knobs a paper fixes (the
policy loss, where the KL penalty goes). The loop, the workers and the config checks read the
preset; nothing else compares ``algorithm.name`` with a string. A new algorithm is a new entry
(and, if its estimator is new, an entry in ``ADVANTAGE_ESTIMATORS``).

Functions here take the ``algorithm`` config section (``megarl.config.schema.AlgorithmConfig``)
duck-typed, as the estimators take tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, List, Tuple

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from megarl.algorithms.kl import KL_ESTIMATORS
from megarl.algorithms.losses import AGG_MODES, POLICY_LOSSES
from megarl.registry import Registry


@dataclass(frozen=True)
class Preset:
    """One RL algorithm: an estimator and what the loop does for it."""

    estimator: str
    """An ADVANTAGE_ESTIMATORS name."""
    critic: bool = False
    """Trains a value model (its values feed the estimator)."""
    prm: bool = False
    """Trains PRIME's implicit process reward model (its token rewards feed the estimator)."""
    min_group: int = 1
    """Samples per prompt the estimator needs (2 for a baseline taken from the prompt's group)."""
    greedy_baseline: bool = False
    """One greedy response per prompt is generated and scored as the baseline (ReMax)."""
    whiten: bool = False
    """Whiten the advantages over the batch's valid tokens (read by GAE; REINFORCE++ whitens by definition)."""
    outcome: bool = True
    """The estimator reads one score per sequence; with the KL in the reward that score is the
    sum of the token rewards, penalty included."""
    policy_loss: str = "ppo"
    """Default of ``algorithm.policy_loss``."""
    kl_in_reward: bool = False
    """Default of ``algorithm.kl_in_reward`` (where the KL-to-reference penalty goes)."""
    knobs: Tuple[Tuple[str, Any], ...] = ()
    """The paper's values of other ``algorithm`` fields that are null by default (each falls back to
    :data:`KNOB_DEFAULTS` in the other presets)."""


KNOB_DEFAULTS = {
    "lam_length_alpha": 0.0,  # off: the policy's GAE lambda is algorithm.lam
    "positive_nll_coef": 0.0,  # no LM loss on positive samples
    "filter_accuracy": False,  # every drawn group is trained
}
"""What a null knob means where the preset does not set it (``lam_critic``: ``lam``)."""


PRESETS: Registry[Preset] = Registry("algorithm")
for _name, _preset in {
    # PPO with a learned critic and GAE (Schulman et al. 2017; Ouyang et al. 2022)
    "ppo": Preset("gae", critic=True, whiten=True, outcome=False),
    # VAPO (Yue et al. 2025, arXiv:2504.05118): PPO with decoupled and length-adaptive GAE and an LM
    # loss on positive samples; value warm-up (trainer.critic_warmup_steps), clip-higher
    # (algorithm.clip_high) and group sampling (samples_per_prompt) are the run's knobs
    "vapo": Preset("gae", critic=True, whiten=True, outcome=False,
                   knobs=(("lam_critic", 1.0), ("lam_length_alpha", 0.05), ("positive_nll_coef", 0.1))),
    # GRPO (Shao et al. 2024): group-normalised outcome reward, KL as a loss term
    "grpo": Preset("grpo", min_group=2),
    # DAPO (Yu et al. 2025): GRPO's estimator; clip-higher, dynamic sampling and overlong shaping are knobs
    "dapo": Preset("grpo", min_group=2),
    # GSPO (Zheng et al. 2025): GRPO's advantages with the sequence-level ratio
    "gspo": Preset("grpo", min_group=2, policy_loss="gspo"),
    "rloo": Preset("rloo", min_group=2),
    # PRIME (Cui et al. 2025): an implicit PRM trained online; RLOO on its token rewards and the outcome
    # (verl-recipe's prime: its online filter keeps groups of mean accuracy in [0.2, 0.8], 4x oversampled)
    "prime": Preset("prime", prm=True, min_group=2, outcome=False, knobs=(("filter_accuracy", True),)),
    # REINFORCE++ (Hu et al. 2025) folds the KL into the token rewards
    "reinforce_pp": Preset("reinforce_pp", outcome=False, kl_in_reward=True),
    "reinforce_pp_baseline": Preset("reinforce_pp_baseline", min_group=2),
    "remax": Preset("remax", greedy_baseline=True),
}.items():
    PRESETS.register(_name)(_preset)


def preset(algo) -> Preset:
    """The preset of ``algo.name``; a ValueError names the field and the algorithms there are."""
    try:
        return PRESETS.get(algo.name)
    except KeyError:
        raise ValueError(f"algorithm.name='{algo.name}' must be one of {PRESETS.names()}") from None


def resolve(algo):
    """A copy of ``algo`` with the preset's defaults filled in (``policy_loss`` and
    ``kl_in_reward`` left null) and every algorithm field checked; a ValueError names the field."""
    p = preset(algo)
    defaults = {"policy_loss": p.policy_loss, "kl_in_reward": p.kl_in_reward, "lam_critic": algo.lam,
                **KNOB_DEFAULTS, **dict(p.knobs)}
    algo = dataclasses.replace(algo, **{k: v for k, v in defaults.items() if getattr(algo, k) is None})
    problems = _problems(algo, p)
    if problems:
        raise ValueError("; ".join(problems))
    return algo


def _problems(algo, p: Preset) -> List[str]:
    out = []

    def one_of(field: str, names) -> None:
        if getattr(algo, field) not in names:
            out.append(f"algorithm.{field}='{getattr(algo, field)}' must be one of {list(names)}")

    one_of("policy_loss", POLICY_LOSSES.names())
    one_of("kl_estimator", KL_ESTIMATORS.names())
    one_of("agg_mode", AGG_MODES)
    assert p.estimator in ADVANTAGE_ESTIMATORS.names(), p  # a preset names a registered estimator
    if algo.samples_per_prompt < p.min_group:
        out.append(f"algorithm.samples_per_prompt={algo.samples_per_prompt}: {algo.name} compares samples of "
                   f"one prompt; use {p.min_group} or more")
    if not 0 < algo.temperature < math.inf:  # also refuses NaN
        # Responses are sampled, and the trainer's log-probs computed (logits / T), at this
        # temperature: at 0 they are undefined and the run goes NaN; n greedy samples are one.
        out.append(f"algorithm.temperature={algo.temperature:g} must be a positive number: RL samples at it "
                   f"and the trainer divides logits by it. Greedy decoding is not a sampling temperature "
                   f"here; for near-greedy samples use a small one, e.g. 0.1 (remax's greedy baseline is "
                   f"generated internally)")
    if not algo.kl_coef >= 0:
        out.append(f"algorithm.kl_coef={algo.kl_coef} must be >= 0")
    if algo.kl_target is not None and not (algo.kl_in_reward and algo.kl_coef > 0):
        out.append(f"algorithm.kl_target={algo.kl_target} (adaptive KL) adapts the coefficient of the KL in the "
                   f"reward, starting at kl_coef: set algorithm.kl_in_reward=true and algorithm.kl_coef > 0 "
                   f"(now kl_in_reward={algo.kl_in_reward}, kl_coef={algo.kl_coef})")
    if not p.critic:
        if algo.lam_length_alpha:
            out.append(f"algorithm.lam_length_alpha={algo.lam_length_alpha} shapes GAE, which {algo.name} does not "
                       f"use (no critic); use algorithm.name=ppo or vapo, or leave it null")
        if algo.lam_critic != algo.lam:
            out.append(f"algorithm.lam_critic={algo.lam_critic} is the GAE lambda of the critic's targets; "
                       f"{algo.name} has no critic: use algorithm.name=ppo or vapo, or leave it null")
    if algo.filter_accuracy and not algo.accuracy_lower_bound <= algo.accuracy_upper_bound:
        out.append(f"algorithm.accuracy_lower_bound={algo.accuracy_lower_bound} must be <= "
                   f"algorithm.accuracy_upper_bound={algo.accuracy_upper_bound}: the filter keeps groups between them")
    if algo.ppo_epochs < 1:
        out.append(f"algorithm.ppo_epochs={algo.ppo_epochs} must be >= 1")
    return out
