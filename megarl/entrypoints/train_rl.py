"""``megarl train``: RL post-training with a single controller on Ray (colocated or split
placement): load the config, check it (:mod:`megarl.controller.prepare`, before any process
starts), start the role groups (:mod:`megarl.controller.roles`), resume, run the loop."""

from __future__ import annotations

import json
import sys
from typing import List

from megarl.config import load_config, to_yaml
from megarl.config.schema import Loop, Placement
from megarl.controller.plan import plan
from megarl.controller.prepare import Prepared, prepare, world_size
from megarl.rollout.backends import rollout_backend
from megarl.runtime.signals import Preemption

__all__ = ["main", "prepare", "run", "Prepared"]


def run(prepared: Prepared) -> List[dict]:
    """Train under ``trainer.run_dir``'s lock (megarl.trainer.run_dir.run_locked)."""
    from megarl.trainer.run_dir import run_locked

    rollout_backend(prepared.cfg.parallel.rollout.engine).check_available(prepared.cfg)
    return run_locked(prepared.cfg.trainer.run_dir, lambda: _run_locked(prepared))


def _run_locked(prepared: Prepared) -> List[dict]:
    from megarl.controller.cluster import RaySession
    from megarl.controller.roles import build_roles, rollout_ranks, start_groups
    from megarl.trainer import loop, one_step_off, streaming
    from megarl.trainer.checkpoint import CheckpointSchedule, Checkpoints, resume
    from megarl.trainer.logger import RunLogger
    from megarl.trainer.steps import KLCoefficient

    cfg, stream, scorer, tok = prepared.cfg, prepared.stream, prepared.scorer, prepared.tokenizer
    preemption = Preemption(cfg.trainer.signal_grace_s)  # SIGTERM: finish the step, checkpoint, exit 143
    try:  # private on loopback, or trainer.ray_address
        session = RaySession(cfg.trainer, num_cpus=world_size(cfg) + rollout_ranks(cfg))
    except BaseException:
        preemption.close()
        raise
    preemption.install()  # over the handler Ray's core worker set
    try:
        groups = start_groups(cfg, session)
    except BaseException:
        preemption.close()
        scorer.close()
        session.close()
        raise
    group = groups[0]
    closing = []  # what the run started beside the roles: closed on the way out
    try:
        roles = build_roles(*groups)
        scorer.attach(roles)
        checkpoints = Checkpoints(cfg.trainer.run_dir, cfg.trainer.keep_checkpoints)
        kl = KLCoefficient(cfg.algorithm) if cfg.algorithm.kl_target is not None else None
        done, run_ids = resume(checkpoints, group, stream, scorer, kl) if cfg.trainer.resume else (0, {})
        log = RunLogger(cfg, cfg.trainer.train_steps, start_step=done, run_ids=run_ids, decode=tok.decode)
        schedule = CheckpointSchedule(
            checkpoints, cfg.trainer, group, lambda step: {
                "step": step, "stream": stream.state_after(step), "reward_failures": scorer.failures,
                "tracker_run_ids": log.run_ids, **({"kl_coef": kl.value} if kl else {})}, to_yaml(cfg), preemption)
        train = {Loop.sync: loop.train, Loop.one_step_off: one_step_off.train, Loop.async_: streaming.train}[cfg.trainer.loop]
        validator = _validator(prepared, roles, closing)
        with schedule.running():  # a SIGTERM from here on lets the step finish
            train(cfg, roles, stream, scorer, log, tok.eos_token_ids, tok.pad_token_id, start_step=done + 1,
                  after_step=schedule.after_step, agent=prepared.agent, validator=validator, kl=kl)
        schedule.finish(blocking=True)
        final = {"step": cfg.trainer.train_steps, "actor_weights_checksum": group.call_first("actor_weights_checksum")}
        (log.run_dir / "final.json").write_text(json.dumps(final))
        png = log.close()
        where = {"mlflow": "mlflow.db", "tensorboard": "tensorboard/", "wandb": "wandb/", "swanlab": "swanlog/"}
        kept = ", ".join(["metrics.jsonl"] + [where[b.value] for b in dict.fromkeys(cfg.logging.backends)
                                              if b.value in where] + [png.name, "final.json"])
        print(f"run directory {log.run_dir}: {kept}", flush=True)
        return log.history
    finally:
        preemption.close()
        for other in [scorer, *closing]:
            other.close()  # the reward workers, even one stuck in a hanging function
        for g in groups:
            g.shutdown()
        session.close()  # Ray, then any process of the run still alive


def _validator(prepared: Prepared, roles, closing: List):
    """data.val_files' Validator, or None. Under split placement one step off the drawing thread
    scores batches meanwhile, so validation gets reward workers of its own (added to ``closing``)."""
    if prepared.val_stream is None:
        return None
    from megarl.trainer.steps import Scorer
    from megarl.trainer.validation import Validator

    cfg, scorer, tok = prepared.cfg, prepared.scorer, prepared.tokenizer
    if cfg.trainer.loop != Loop.sync and cfg.trainer.placement == Placement.split:
        scorer = Scorer(cfg.algorithm, tok, cfg.reward_model)
        scorer.attach(roles)
        closing.append(scorer)
    return Validator(prepared.val_stream, scorer, cfg.algorithm, tok.eos_token_ids, cfg.trainer.seed, tok.decode)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    files = [a for a in argv if a.endswith((".yaml", ".yml"))]
    prepared = prepare(load_config(files, [a for a in argv if a not in files]))
    if dry_run:
        print(plan(prepared.cfg, prepared.layout))
        return 0
    history = run(prepared)
    if history:
        first, last = history[: max(1, len(history) // 10)], history[-max(1, len(history) // 10):]
        mean = lambda rows: sum(r["reward/mean"] for r in rows) / len(rows)
        print(json.dumps({"steps": len(history), "reward_first_10pct": round(mean(first), 4),
                          "reward_last_10pct": round(mean(last), 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
