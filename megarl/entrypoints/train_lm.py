"""Tiny multi-process Megatron training on the built-in reverse-digits task (every rank runs this).

Shows the whole stack working on any machine: the layout's process groups, a GPTModel built
from an HF config, Megatron DDP with the distributed optimizer, the pipeline schedule, and the
loss falling. Start it with ``megarl train-lm`` (which launches torchrun).
"""

from __future__ import annotations

import sys
import time

import torch

from megarl.config import MegarlConfig, load_config
from megarl.parallel import Layout, build_groups
from megarl.runtime import init_distributed, set_seed, shutdown
from megarl.training import lm
from megarl.training.tasks import reverse_digits_batch


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    files = [a for a in argv if a.endswith((".yaml", ".yml"))]
    cfg: MegarlConfig = load_config(files, [a for a in argv if a not in files])
    init_distributed()
    layout = Layout.from_config(cfg.parallel.actor, torch.distributed.get_world_size())
    groups = build_groups(layout)
    set_seed(cfg.trainer.seed, groups)
    state = lm.build_train_state(cfg.model, cfg.optimizer, groups, cfg.trainer.train_steps)
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        print(f"megarl train-lm: {cfg.model.hf_config} layout {layout} on {torch.distributed.get_world_size()} "
              f"processes ({'gloo/CPU' if not torch.cuda.is_available() else 'nccl/GPU'})", flush=True)
    first = last = None
    start = time.perf_counter()
    for step in range(cfg.trainer.train_steps):
        batch = reverse_digits_batch(step, cfg.data.global_batch_size, cfg.data.num_digits, cfg.trainer.seed)
        metrics = lm.train_step(state, lm.dp_shard(batch, groups), cfg.data.micro_batch_size)
        first = metrics["loss"] if first is None else first
        last = metrics["loss"]
        if rank0 and (step % cfg.trainer.log_interval == 0 or step == cfg.trainer.train_steps - 1):
            print(f"step {step:4d}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}  "
                  f"lr {metrics['lr']:.2e}  {time.perf_counter() - start:6.1f}s", flush=True)
    if rank0:
        print(f"loss fell from {first:.4f} to {last:.4f} in {cfg.trainer.train_steps} steps", flush=True)
    shutdown()
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
