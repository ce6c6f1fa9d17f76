"""Native rollout throughput: KV cache against full recomputation, and batch-size scaling.

    python benchmarks/rollout.py [--max-new 64]

Each setting runs under torchrun on this machine (gloo on CPU, NCCL on GPUs): the actor is built
in its training layout, the rollout in the generation layout is fed by the hybrid engine, and
greedy decoding of random prompts (16-48 tokens) runs with and without the KV cache. Tokens/s
counts generated tokens over the wall time of ``generate``, best of two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 512}
SETTINGS = {  # processes -> [(training t, generation t_g, batch sizes)]
    1: [(1, 1, [1, 4, 16, 64])],
    2: [(2, 1, [16]), (2, 2, [16])],
}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megarl.config import ModelConfig
    from megarl.hybrid import regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout, build_groups
    from megarl.rollout import SamplingParams
    from megarl.rollout.native import NativeRollout
    from megarl.runtime import init_distributed, set_seed
    from megarl.training import lm

    init_distributed()
    world = dist.get_world_size()
    model_cfg = ModelConfig(hf_config=args.model)
    margs = megatron_args_from_hf(args.model)
    for tp, gen_tp, batches in SETTINGS[world]:
        groups = build_groups(Layout(tp=tp, dp=world // tp))
        set_seed(0, groups)
        state = lm.build_frozen_state(model_cfg, groups)
        rollout = NativeRollout(model_cfg, margs, regroup(groups.layout, gen_tp), state.model)
        rollout.update_weights(0)
        gen = torch.Generator().manual_seed(0)
        for batch in batches:
            prompts = [torch.randint(3, margs.vocab_size, (int(n),), generator=gen).tolist()
                       for n in torch.randint(16, 49, (batch,), generator=gen)]
            sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new)
            row = {"processes": world, "tp": tp, "gen_tp": gen_tp, "batch": batch}
            for cache in (True, False):
                rollout.kv_cache = cache
                best = float("inf")
                for _ in range(2):
                    dist.barrier()
                    responses = rollout.generate(prompts, sampling)
                    best = min(best, rollout.last.seconds)
                tokens = sum(r.length for r in responses)
                row["kv_cache" if cache else "recompute"] = tokens / best
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(row), flush=True)
        groups.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "worker"])
    parser.add_argument("--model", default="")
    parser.add_argument("--max-new", type=int, default=64)
    args = parser.parse_args()
    if args.what == "worker":
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    print(f"model: llama, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab "
          f"{MODEL['vocab_size']}; {args.max_new} new tokens per prompt, greedy")
    print(f"{'procs':>5s} {'t':>2s} {'t_g':>3s} {'batch':>5s} {'KV cache tok/s':>15s} {'recompute tok/s':>16s} {'speed-up':>9s}")
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "model.json"
        path.write_text(json.dumps(MODEL))
        for world in SETTINGS:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   __file__, "worker", "--model", str(path), "--max-new", str(args.max_new)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[7:])
                    print(f"{r['processes']:5d} {r['tp']:2d} {r['gen_tp']:3d} {r['batch']:5d} {r['kv_cache']:15.1f} "
                          f"{r['recompute']:16.1f} {r['kv_cache'] / r['recompute']:8.1f}x")


if __name__ == "__main__":
    main()
