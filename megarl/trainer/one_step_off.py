"""One-step-off-policy loop: the rollout of step k+1 is drawn from the weights before update k,
so generation can run beside training (split placement); the trained batch is one policy
version stale, and the measured staleness is logged. The training half is the synchronous
loop's (:func:`train_on`); only the schedule of generation and weight sync differs.

With colocated placement the two calls queue on the same workers (no overlap); the staleness,
and so the algorithm, is the same. A resumed run draws its first batch afresh (staleness 0).
"""

from __future__ import annotations

from typing import Sequence

from megarl.trainer.steps import make_batch, sample_step, sampling_metrics, train_on


def train(cfg, roles, stream, scorer, log, eos_token_ids: Sequence[int], pad_token_id: int, start_step: int = 1,
          after_step=None) -> None:
    algo, data = cfg.algorithm, cfg.data

    def draw(step):
        return sample_step(roles.rollout, stream, scorer, algo, data.prompts_per_step,
                           seed=cfg.trainer.seed + step, eos_token_ids=eos_token_ids, phase=log.phase)

    roles.rollout.update_weights(start_step - 1)
    pending, pending_version = draw(start_step), start_step - 1
    for step in range(start_step, cfg.trainer.train_steps + 1):
        sampled, version = pending, pending_version
        if step < cfg.trainer.train_steps:  # drawn from version step-1, before this step's update
            pending, pending_version = draw(step + 1), step - 1
        roles.rollout.release_memory()  # the training roles get the device (hybrid engine)
        batch, metrics = train_on(make_batch(sampled, pad_token_id, policy_version=version), roles, algo, log)
        metrics = {"sampling/staleness": (step - 1) - version,  # actor version - batch version
                   **sampling_metrics(sampled), **metrics}
        with log.phase("weight_sync"):
            roles.rollout.resume_memory()
            metrics |= roles.rollout.update_weights(step)
        log.step(step, batch, metrics)
        if after_step:
            after_step(step)  # checkpoint
