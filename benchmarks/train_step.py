"""Training-step throughput of a tiny model at several layouts, side by side in one run.

    python benchmarks/train_step.py [--model configs/models/tiny-llama.json] [--steps 10]
        [--ppo 1x1 4x2]

Each layout runs under torchrun on this machine (gloo on CPU, NCCL on GPUs); the table gives
tokens/s of forward+backward+optimizer and the ratio to the single-process layout. On a
2-core CPU machine more processes mostly add communication: the numbers are for spotting
regressions between layouts, not for scaling claims.

A second table times one actor update of an RL step (PPO loss + k3 KL + entropy, on the same
batch with fixed old log-probs) at the first layout, for each ``MINIxEPOCHS`` schedule of
``--ppo``: seconds per RL step, optimizer steps, and its cost relative to the first schedule
(4x2 trains every token twice in 8 optimizer steps, so about 2x plus 7 optimizer steps' overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ["1,1,1", "2,1,1", "1,2,1", "1,1,2"]  # t,p,d


def worker(args) -> None:
    import torch

    from megarl.config import ModelConfig, OptimizerConfig
    from megarl.engines import supervised
    from megarl.engines.megatron_engine import MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.parallel import Layout, build_groups
    from megarl.runtime import init_distributed, set_seed
    from megarl.tasks.reverse_digits import reverse_digits_batch

    init_distributed()
    tp, pp, dp = (int(x) for x in args.layout.split(","))
    groups = build_groups(Layout(tp=tp, pp=pp, dp=dp))
    set_seed(0, groups)
    state = build_train_state(ModelConfig(hf_config=args.model), OptimizerConfig(), groups, args.steps + 2)
    engine, how = supervised.engine(state), MicroBatching(args.micro)
    batch = reverse_digits_batch(0, args.batch, args.digits, seed=0)
    for _ in range(2):  # warm-up
        supervised.train_step(engine, supervised.dp_shard(batch, groups), how)
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        supervised.train_step(engine, supervised.dp_shard(batch, groups), how)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    if torch.distributed.get_rank() == 0:
        tokens = args.steps * batch["tokens"].numel()
        record = {"layout": args.layout, "tokens_per_s": tokens / seconds, "step_s": seconds / args.steps}
        if torch.cuda.is_available():
            # Model FLOPs utilisation: 6 * parameters per trained token (Kaplan et al. 2020),
            # against the stated dense bf16 peak of every GPU in the world.
            flops = 6 * dense_params(args.model) * tokens / seconds
            record["mfu"] = flops / (args.peak_tflops * 1e12 * torch.distributed.get_world_size())
        print("RESULT " + json.dumps(record), flush=True)


def ppo_worker(args) -> None:
    """Time ``actor.update`` on one RL batch with PPO mini-batches x epochs ``args.schedule``."""
    import torch

    from megarl.config import ModelConfig, OptimizerConfig
    from megarl.engines import supervised
    from megarl.engines.megatron_engine import MegatronEngine, MicroBatching, MiniBatches
    from megarl.engines.train_state import build_train_state
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout, build_groups
    from megarl.roles.actor import Actor, ActorLossConfig
    from megarl.runtime import init_distributed, set_seed
    from megarl.tasks.reverse_digits import reverse_digits_batch

    init_distributed()
    tp, pp, dp = (int(x) for x in args.layout.split(","))
    groups = build_groups(Layout(tp=tp, pp=pp, dp=dp))
    set_seed(0, groups)
    mini_batches, epochs = (int(x) for x in args.schedule.split("x"))
    mini = MiniBatches(size=args.batch // mini_batches, epochs=epochs, seed=0)
    updates = args.steps + 1
    state = build_train_state(ModelConfig(hf_config=args.model), OptimizerConfig(lr=1e-5), groups,
                              updates * mini_batches * epochs)
    actor = Actor(MegatronEngine(state, megatron_args_from_hf(args.model).vocab_size),
                  ActorLossConfig(kl_coef=0.01, entropy_coef=0.01))
    batch = supervised.dp_shard(reverse_digits_batch(0, args.batch, args.digits, seed=0), groups)
    lengths = torch.full((batch["tokens"].shape[0],), batch["tokens"].shape[1])
    how = MicroBatching(micro_batch_size=args.micro)
    gen = torch.Generator().manual_seed(groups.dp_rank)
    logp = actor.compute_log_prob(batch, lengths, how)
    mask = batch["loss_mask"]
    batch |= {"old_log_probs": logp * mask, "ref_log_probs": logp * mask,
              "advantages": torch.randn(lengths.shape[0], 1, generator=gen).expand_as(mask) * mask}
    actor.update(batch, lengths, how, mini)  # warm-up
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = actor.update(batch, lengths, how, mini)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"schedule": args.schedule, "rl_step_s": seconds / args.steps,
                                      "optimizer_steps": metrics["optimizer_steps"]}), flush=True)


def dense_params(hf_config: str) -> int:
    """Parameters of a dense HF config (attention with GQA, gated MLP, embeddings)."""
    from megarl.models.hf_config import megatron_args_from_hf

    args = megatron_args_from_hf(hf_config)
    kw = args.config_kwargs
    h, heads, groups, d = kw["hidden_size"], kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]
    attention = h * (heads + 2 * groups) * d + heads * d * h
    mlp = 3 * h * kw["ffn_hidden_size"]
    return kw["num_layers"] * (attention + mlp) + 2 * args.vocab_size * h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/models/tiny-llama.json")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, help="t,p,d triples")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--digits", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak per GPU for the MFU line (H100/H200 SXM: 989)")
    parser.add_argument("--ppo", nargs="*", default=["1x1", "4x2"],
                        help="PPO mini-batches x epochs schedules to time (none: skip the table)")
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        return ppo_worker(args) if args.schedule else worker(args)
    rows = [launch(args, layout) for layout in args.layouts]
    base = rows[0]["tokens_per_s"]
    print(f"model {args.model}, global batch {args.batch} x {2 * args.digits + 1} tokens, {args.steps} timed steps")
    print(f"{'t,p,d':>8} {'tokens/s':>10} {'s/step':>8} {'ratio':>6}")
    for row in rows:
        mfu = f"  MFU {row['mfu']:.1%}" if "mfu" in row else ""
        print(f"{row['layout']:>8} {row['tokens_per_s']:10.0f} {row['step_s']:8.3f} {row['tokens_per_s'] / base:6.2f}{mfu}")
    if not args.ppo:
        return
    rows = [launch(args, args.layouts[0], "--schedule", schedule) for schedule in args.ppo]
    print(f"\nactor update of one RL step at t,p,d={args.layouts[0]}: PPO mini-batches x epochs")
    print(f"{'schedule':>8} {'optim steps':>11} {'s/RL step':>10} {'cost':>6}")
    for row in rows:
        print(f"{row['schedule']:>8} {row['optimizer_steps']:11.0f} {row['rl_step_s']:10.3f} "
              f"{row['rl_step_s'] / rows[0]['rl_step_s']:6.2f}")


def launch(args, layout: str, *extra: str) -> dict:
    """Run this file's worker under torchrun at ``layout``; its RESULT record."""
    world = 1
    for size in layout.split(","):
        world *= int(size)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--layout", layout, "--model", args.model, "--steps", str(args.steps),
           "--batch", str(args.batch), "--micro", str(args.micro), "--digits", str(args.digits),
           "--peak-tflops", str(args.peak_tflops), *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    found = [json.loads(l[7:]) for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not found:
        sys.exit(f"layout {layout} {' '.join(extra)} failed:\n{out.stderr[-3000:]}")
    return found[0]


if __name__ == "__main__":
    main()
