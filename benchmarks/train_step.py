"""Training-step throughput of a tiny model at several layouts, side by side in one run.

    python benchmarks/train_step.py [--model configs/models/tiny-llama.json] [--steps 10]

Each layout runs under torchrun on this machine (gloo on CPU, NCCL on GPUs); the table gives
tokens/s of forward+backward+optimizer and the ratio to the single-process layout. On a
2-core CPU machine more processes mostly add communication: the numbers are for spotting
regressions between layouts, not for scaling claims.
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
    from megarl.parallel import Layout, build_groups
    from megarl.runtime import init_distributed, set_seed
    from megarl.training import lm
    from megarl.training.tasks import reverse_digits_batch

    init_distributed()
    tp, pp, dp = (int(x) for x in args.layout.split(","))
    groups = build_groups(Layout(tp=tp, pp=pp, dp=dp))
    set_seed(0, groups)
    state = lm.build_train_state(ModelConfig(hf_config=args.model), OptimizerConfig(), groups, args.steps + 2)
    batch = reverse_digits_batch(0, args.batch, args.digits, seed=0)
    for _ in range(2):  # warm-up
        lm.train_step(state, lm.dp_shard(batch, groups), args.micro)
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        lm.train_step(state, lm.dp_shard(batch, groups), args.micro)
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
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        return worker(args)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    rows = []
    for layout in args.layouts:
        world = 1
        for size in layout.split(","):
            world *= int(size)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               __file__, "--layout", layout, "--model", args.model, "--steps", str(args.steps),
               "--batch", str(args.batch), "--micro", str(args.micro), "--digits", str(args.digits),
               "--peak-tflops", str(args.peak_tflops)]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        found = [json.loads(l[7:]) for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not found:
            sys.exit(f"layout {layout} failed:\n{out.stderr[-3000:]}")
        rows.append(found[0])
    base = rows[0]["tokens_per_s"]
    print(f"model {args.model}, global batch {args.batch} x {2 * args.digits + 1} tokens, {args.steps} timed steps")
    print(f"{'t,p,d':>8} {'tokens/s':>10} {'s/step':>8} {'ratio':>6}")
    for row in rows:
        mfu = f"  MFU {row['mfu']:.1%}" if "mfu" in row else ""
        print(f"{row['layout']:>8} {row['tokens_per_s']:10.0f} {row['step_s']:8.3f} {row['tokens_per_s'] / base:6.2f}{mfu}")


if __name__ == "__main__":
    main()
