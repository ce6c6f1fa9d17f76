"""The RL loop of the single controller (HybridFlow): each phase is one verb on a role.

generate → reward → (the training half, :func:`train_on`: old log-prob → reference log-prob →
values → advantages → critic update → actor update) → weight sync → metrics. Roles run on their
worker groups; nothing here touches a process group.
"""

from __future__ import annotations

from typing import Sequence

from megarl.trainer.steps import make_batch, sample_step, sampling_metrics, train_on


def validate(cfg, roles, validator, log, step: int, rollout=None) -> None:
    """Held-out evaluation on the rollout's current weights (trainer.val_interval; step 0 with
    trainer.val_before_train), logged apart from the step's metrics. ``rollout``: what generates
    (the one-step-off loop's, whose generate calls take turns with the drawing thread's); default
    the rollout role."""
    if validator is None:
        return
    t = cfg.trainer
    if (step == 0 and t.val_before_train) or (step and t.val_interval and step % t.val_interval == 0):
        log.validation(step, *validator.run(rollout or roles.rollout))


def train(cfg, roles, stream, scorer, log, eos_token_ids: Sequence[int], pad_token_id: int, start_step: int = 1,
          after_step=None, agent=None, validator=None, kl=None) -> None:
    algo, data = cfg.algorithm, cfg.data
    roles.rollout.update_weights(start_step - 1)
    if start_step == 1:
        validate(cfg, roles, validator, log, 0)
    for step in range(start_step, cfg.trainer.train_steps + 1):
        sampled = sample_step(roles.rollout, stream, scorer, algo, data.prompts_per_step,
                              seed=cfg.trainer.seed + step, eos_token_ids=eos_token_ids, phase=log.phase, agent=agent)
        roles.rollout.release_memory()  # the training roles get the device (hybrid engine)
        batch, metrics = train_on(make_batch(sampled, pad_token_id, policy_version=step - 1), roles, algo, log, step,
                                  kl, critic_only=step <= cfg.trainer.critic_warmup_steps)
        metrics = sampling_metrics(sampled) | metrics
        with log.phase("weight_sync"):
            roles.rollout.resume_memory()
            metrics |= roles.rollout.update_weights(step)
        log.step(step, batch, metrics)
        validate(cfg, roles, validator, log, step)
        if after_step:
            after_step(step)  # checkpoint
