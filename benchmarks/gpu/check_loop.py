"""The RL loop without Ray, for a GPU machine that has no Ray (its wheel is larger than what a lent
machine can carry): every rank runs megarl's own loop (megarl.trainer.loop.train) in SPMD, with
its RLWorker's verbs called in place of the worker group's. Data parallelism must be 1 (each rank
then holds every row); tp or pp span the ranks.

    python3 benchmarks/gpu/check_loop.py RUN_DIR [key=value ...]            # one GPU: a world of one
    torchrun --nproc-per-node N benchmarks/gpu/check_loop.py RUN_DIR [...]  # tp=N over N ranks

Defaults: the demo's GRPO config at actor tp=N with a reference (``algorithm.kl_coef=0.01``),
3 steps, then a checkpoint of the last step saved and loaded back, the weights checksum equal.
Prints on rank 0: ``LOOP`` lines (per step: reward, log-prob agreement, ratio, phase seconds,
offload and reload seconds, megarl's memory metrics), ``PHASE`` lines (per verb the loop called:
seconds, and after it torch's allocated and reserved memory, the reserved high-water mark
``max_memory_reserved``, and the device's used memory from ``mem_get_info``, which counts every
process), a ``CKPT`` line, then ``LOOP_OK`` or ``LOOP_FAILED`` with the reasons. Under the test
suite it runs through the GPU-shaped harness (MEGARL_GPU_SHAPED=1)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
from check_parity import TOLERANCES  # beside this script

from megarl.config import load_config
from megarl.config.schema import ParamsDtype
from megarl.controller.rl_worker import RLWorker
from megarl.controller.roles import Roles
from megarl.entrypoints.train_rl import prepare
from megarl.protocol import declared_verbs
from megarl.trainer.logger import RunLogger
from megarl.trainer.loop import train

DEFAULTS = ["algorithm.name=grpo", "algorithm.kl_coef=0.01", "algorithm.samples_per_prompt=4",
            "data.prompts_per_step=8", "trainer.train_steps=3", "logging.backends=[console]", "logging.progress_bar=false"]
# the first PPO ratio, old log-probs being the trainer's own: 1 up to the kernels' reduction order
RATIO_BOUND = 1e-3
GB = 2**30


class PhaseMeter:
    """Seconds and device memory of each verb the loop calls, by ``role.verb``: the calls' total
    and slowest seconds, and the largest of each memory reading taken right after a call."""

    def __init__(self):
        self.phases = {}

    def run(self, phase: str, call):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        free, total = torch.cuda.mem_get_info()
        reading = {"allocated_gb": torch.cuda.memory_allocated() / GB, "reserved_gb": torch.cuda.memory_reserved() / GB,
                   "max_reserved_gb": torch.cuda.max_memory_reserved() / GB, "device_used_gb": (total - free) / GB}
        row = self.phases.setdefault(phase, {"calls": 0, "seconds_total": 0.0, "seconds_max": 0.0})
        row["calls"] += 1
        row["seconds_total"] += seconds
        row["seconds_max"] = max(row["seconds_max"], seconds)
        for key, value in reading.items():
            row[key] = max(row.get(key, 0.0), value)
        return out


class LocalRole:
    """A role's verbs on this rank's worker: what RoleProxy does over Ray, for dp=1 in SPMD."""

    def __init__(self, worker: RLWorker, role: str, meter: PhaseMeter):
        self.worker, self.role, self.meter = worker, role, meter
        self.verbs = declared_verbs(type(worker.roles[role]))

    def __getattr__(self, name: str):
        if name not in self.__dict__.get("verbs", {}):
            raise AttributeError(f"role '{self.role}' has no verb '{name}'")
        return lambda *args, **kwargs: self.meter.run(f"{self.role}.{name}", lambda: self.worker.call(
            self.role, name, *args, **kwargs))


def world_of_one() -> None:
    """Started without torchrun: rank 0 of 1 on a free loopback port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def failures(rows, cfg, logp_bound: float) -> list:
    """What the run's metrics say is wrong (empty when nothing)."""
    out = []
    if len(rows) != cfg.trainer.train_steps:
        out.append(f"{len(rows)} of {cfg.trainer.train_steps} steps logged")
    if not rows:
        return out
    first = rows[0]
    if not first["rollout/logp_max_abs_diff"] <= logp_bound:
        out.append(f"rollout/logp_max_abs_diff {first['rollout/logp_max_abs_diff']} > {logp_bound}")
    if not abs(first["actor/ratio_mean"] - 1) <= RATIO_BOUND:
        out.append(f"first actor/ratio_mean {first['actor/ratio_mean']} is not 1 within {RATIO_BOUND}")
    off = cfg.trainer.offload
    for row in rows:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            out.append(f"step {row['step']}: not finite: {bad}")
        if (off.params or off.grads or off.optimizer) and not ("time/offload_s" in row and "time/reload_s" in row):
            out.append(f"step {row['step']}: trainer.offload is on but time/offload_s or time/reload_s is missing")
    return out


def main(run_dir: str, overrides: list) -> None:
    world_of_one()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = Path(run_dir) if rank == 0 else Path(run_dir) / f"rank{rank}"  # one writer of the run's files
    cfg = load_config(["configs/grpo_demo.yaml"], [f"parallel.actor.tp={world}", f"trainer.nproc_per_node={world}",
                                                    *DEFAULTS, *overrides, f"trainer.run_dir={base}"])
    prepared = prepare(cfg)
    cfg = prepared.cfg
    meter = PhaseMeter()
    worker = RLWorker(rank, world, cfg)
    start = time.perf_counter()  # no device call before setup: it picks this rank's GPU
    info = worker.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    setup_s = time.perf_counter() - start
    if info["dp"] != 1:
        raise SystemExit(f"check_loop runs dp=1 only (got dp={info['dp']}): set parallel.actor.tp/pp to span the ranks")
    roles = Roles(**{name: LocalRole(worker, name, meter) for name in ("actor", "rollout", "reference", "critic")
                     if name in worker.roles})
    prepared.scorer.model = LocalRole(worker, "reward_model", meter) if "reward_model" in worker.roles else None
    log = RunLogger(cfg, cfg.trainer.train_steps, decode=prepared.tokenizer.decode)
    last = Path(run_dir) / "checkpoints" / f"step_{cfg.trainer.train_steps}"  # every rank writes its shards here

    def after_step(step: int) -> None:
        if step < cfg.trainer.train_steps:
            return
        if rank == 0:
            last.mkdir(parents=True)
        torch.distributed.barrier()
        worker.save_checkpoint(str(last))
        worker.finish_checkpoint(blocking=True)

    tok = prepared.tokenizer
    try:
        train(cfg, roles, prepared.stream, prepared.scorer, log, tok.eos_token_ids, tok.pad_token_id,
              after_step=lambda step: meter.run("checkpoint.save", lambda: after_step(step)))
    finally:
        prepared.scorer.close()
    before = worker.actor_weights_checksum()
    same_layout = meter.run("checkpoint.load", lambda: worker.load_checkpoint(str(last)))
    after = worker.actor_weights_checksum()
    if rank == 0:
        rows = [json.loads(line) for line in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]
        for row in rows:
            print("LOOP " + json.dumps({k: row[k] for k in sorted(row) if k.startswith(
                ("reward/mean", "rollout/logp_max_abs_diff", "actor/ratio_mean", "actor/grad_norm", "critic/loss",
                 "time/", "memory/", "perf/", "response/length_mean", "batch/rows", "sync/seconds"))}
                | {"step": row["step"]}), flush=True)
        for phase, row in meter.phases.items():
            print("PHASE " + json.dumps({"phase": phase} | {k: round(v, 4) for k, v in row.items()}), flush=True)
        print("SETUP " + json.dumps({"seconds": round(setup_s, 2), "model": cfg.model.hf_config}), flush=True)
        print("CKPT " + json.dumps({"checksum": before, "reloaded_checksum": after, "same_layout": same_layout}),
              flush=True)
        bf16 = cfg.model.params_dtype == ParamsDtype.bfloat16 or (
            cfg.model.params_dtype == ParamsDtype.auto and torch.cuda.is_available())
        # the rollout's log-probs against the trainer's: check_parity.py's bound for the dtype
        wrong = failures(rows, cfg, TOLERANCES[f"rollout_vs_trainer/{'bfloat16' if bf16 else 'float32'}"]["max_abs"])
        if before != after or not same_layout:
            wrong.append(f"the checkpoint reloaded other weights (checksum {before} -> {after}, "
                         f"same_layout={same_layout})")
        print("LOOP_OK" if not wrong else "LOOP_FAILED " + json.dumps(wrong), flush=True)
        if wrong:
            raise SystemExit(1)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
