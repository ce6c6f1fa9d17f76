"""The RL loop without Ray, for a GPU machine that has no Ray (its wheel is larger than what a lent
machine can carry): every torchrun rank runs megarl's own loop (megarl.trainer.loop.train) in
SPMD, with its RLWorker's verbs called in place of the worker group's. Data parallelism must be 1
(each rank then holds every row); tp or pp span the ranks.

    torchrun --nproc-per-node N benchmarks/gpu/check_loop.py RUN_DIR [key=value ...]

Defaults: the demo's GRPO config at actor tp=N, PPO's roles (critic and reference) with
``algorithm.name=ppo algorithm.kl_coef=0.01``, 3 steps, a checkpoint after each step loaded back
after the last, and the final weights checksum. Prints ``LOOP`` lines on rank 0 (per step: reward,
log-prob agreement, phase seconds, peak GPU memory per phase) and ``LOOP_OK``. Under the test
suite it runs through the GPU-shaped harness (MEGARL_GPU_SHAPED=1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megarl.config import load_config
from megarl.controller.rl_worker import RLWorker
from megarl.controller.roles import Roles
from megarl.entrypoints.train_rl import prepare
from megarl.protocol import declared_verbs
from megarl.trainer.logger import RunLogger
from megarl.trainer.loop import train

DEFAULTS = ["algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.samples_per_prompt=4",
            "data.prompts_per_step=8", "trainer.train_steps=3", "logging.mlflow=false", "logging.progress_bar=false"]


class LocalRole:
    """A role's verbs on this rank's worker: what RoleProxy does over Ray, for dp=1 in SPMD."""

    def __init__(self, worker: RLWorker, role: str):
        self.worker, self.role = worker, role
        self.verbs = declared_verbs(type(worker.roles[role]))

    def __getattr__(self, name: str):
        if name not in self.__dict__.get("verbs", {}):
            raise AttributeError(f"role '{self.role}' has no verb '{name}'")
        return lambda *args, **kwargs: self.worker.call(self.role, name, *args, **kwargs)


def main(run_dir: str, overrides: list) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = Path(run_dir) if rank == 0 else Path(run_dir) / f"rank{rank}"  # one writer of the run's files
    cfg = load_config(["configs/grpo_demo.yaml"], [f"parallel.actor.tp={world}", f"trainer.nproc_per_node={world}",
                                                    *DEFAULTS, *overrides, f"trainer.run_dir={base}"])
    prepared = prepare(cfg)
    cfg = prepared.cfg
    worker = RLWorker(rank, world, cfg)
    info = worker.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if info["dp"] != 1:
        raise SystemExit(f"check_loop runs dp=1 only (got dp={info['dp']}): set parallel.actor.tp/pp to span the ranks")
    roles = Roles(**{name: LocalRole(worker, name) for name in ("actor", "rollout", "reference", "critic")
                     if name in worker.roles})
    prepared.scorer.model = LocalRole(worker, "reward_model") if "reward_model" in worker.roles else None
    log = RunLogger(cfg, cfg.trainer.train_steps, decode=prepared.tokenizer.decode)
    ckpt = Path(run_dir) / "checkpoints"  # one directory that every rank writes its shards into

    def after_step(step: int) -> None:
        if rank == 0:
            (ckpt / f"step_{step}").mkdir(parents=True)
        torch.distributed.barrier()
        worker.save_checkpoint(str(ckpt / f"step_{step}"))
        worker.finish_checkpoint(blocking=True)

    tok = prepared.tokenizer
    try:
        train(cfg, roles, prepared.stream, prepared.scorer, log, tok.eos_token_ids, tok.pad_token_id,
              after_step=after_step)
    finally:
        prepared.scorer.close()
    before = worker.actor_weights_checksum()
    same_layout = worker.load_checkpoint(str(ckpt / f"step_{cfg.trainer.train_steps}"))
    after = worker.actor_weights_checksum()
    if rank == 0:
        for line in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            print("LOOP " + json.dumps({k: row[k] for k in sorted(row) if k.startswith(
                ("reward/mean", "rollout/logp_max_abs_diff", "actor/ratio_mean", "critic/loss", "time/", "memory/",
                 "perf/peak"))} | {"step": row["step"]}), flush=True)
        print("LOOP " + json.dumps({"checksum": before, "reloaded_checksum": after, "same_layout": same_layout}))
        ok = before == after and same_layout
        print("LOOP_OK" if ok else "LOOP_FAILED", flush=True)
        if not ok:
            raise SystemExit(1)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
