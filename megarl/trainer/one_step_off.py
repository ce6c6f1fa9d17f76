"""Asynchronous loop: batch k is drawn from older weights than the actor it trains, so
generation can run beside training. The training half is the synchronous loop's
(:func:`train_on`); only the schedule of drawing and weight sync differs (:class:`Producer`).

``trainer.max_staleness`` = 0: one step off, batch k + 1 drawn from the weights before update k.
N >= 1: streaming, batches drawn up to N versions ahead. Split placement draws in a driver
thread while the trainer's ranks train; colocated placement has no ranks to spare, so there the
draw runs in line (the staleness without the overlap). Each row carries the policy version that
generated it; the staleness (actor version - row version) is logged. A resumed run draws its
first batch afresh.
"""

from __future__ import annotations

from typing import Sequence

from megarl.config.schema import Placement
from megarl.trainer.loop import validate
from megarl.trainer.producer import LockedRollout, Producer
from megarl.trainer.steps import make_batch, sample_step, sampling_metrics, staleness_metrics, train_on


def train(cfg, roles, stream, scorer, log, eos_token_ids: Sequence[int], pad_token_id: int, start_step: int = 1,
          after_step=None, agent=None, validator=None, kl=None) -> None:
    """``validator`` (data.val_files): after the weight sync of a validation step, on that version's
    weights; under split placement its generate calls take turns with the drawing thread's (each
    call whole, as the draws' own), and it scores with its own reward workers."""
    algo, data, t = cfg.algorithm, cfg.data, cfg.trainer

    def draw(step, rollout, phase):
        sampled = sample_step(rollout, stream, scorer, algo, data.prompts_per_step, seed=t.seed + step,
                              eos_token_ids=eos_token_ids, phase=phase, agent=agent)
        stream.mark(step)  # the checkpoint of this step resumes here, before the batches drawn ahead
        return sampled

    roles.rollout.update_weights(start_step - 1)
    if start_step == 1:
        validate(cfg, roles, validator, log, 0)
    r = cfg.parallel.rollout
    producer = Producer(draw, roles.rollout, start_step, t.train_steps, bound=t.max_staleness or 1,
                        threaded=t.placement == Placement.split, chunk=r.partial_chunk_tokens if r.partial_rollout else None,
                        deadline_s=t.hang_timeout_s)
    try:
        for step in range(start_step, t.train_steps + 1):
            with log.phase("wait_rollout"):  # what generation and scoring did not hide
                sampled, seconds = producer.take(step)
            roles.rollout.release_memory()  # colocated: the training roles get the device
            batch = make_batch(sampled, pad_token_id)
            batch, metrics = train_on(batch, roles, algo, log, step, kl, critic_only=step <= t.critic_warmup_steps)
            metrics = {**staleness_metrics(sampled, step - 1, t.max_staleness or 1),
                       **{f"time/{k}_s": v for k, v in seconds.items()}, **sampling_metrics(sampled), **metrics}
            with log.phase("weight_sync"):
                roles.rollout.resume_memory()
                metrics |= producer.sync(lambda: roles.rollout.update_weights(step), step)
            log.step(step, batch, metrics)
            validate(cfg, roles, validator, log, step, rollout=LockedRollout(producer))
            if after_step:
                after_step(step)  # checkpoint: the stream as it was once this step's batch was drawn
            stream.forget(step)
    finally:
        producer.stop()
