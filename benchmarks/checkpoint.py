"""Training-state checkpoints: the optimizer formats and async save, side by side in one run.

    python benchmarks/checkpoint.py [--world 2] [--layout 1,1,2] [--repeats 2]

Each format saves and loads the same state (a ~30M-parameter Llama, fp32, Adam moments filled by
one step) under torchrun on this machine: ``dp_reshardable`` (Megatron's bucket space, no
gather), ``reshardable`` (model space: each parameter's state gathered over dp, resumable in any
layout), and ``reshardable`` with async save (the time the trainer is blocked, and the time until
the background write is finalized). Best of ``--repeats``; ratios against ``dp_reshardable``.

Beside each save (written without hashes), the hashing, before and after. Before: the driver
alone hashes every file as it writes the manifest (``driver %``: the time it adds to the sizes-only
manifest, against the time until the checkpoint is written). After (what the trainer does): each
rank hashes the files it wrote (``record_hashes``, in parallel; in an async save the background
writer makes the same call after writing), then the driver merges their digests into the
manifest and hashes the rest (``ranks %``: the slowest rank plus the merge, against the same).
``--repeats 1`` is the quick run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192, "max_position_embeddings": 512}
MODES = ("dp_reshardable", "reshardable", "reshardable+async")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megarl.checkpoint.integrity import record_hashes, write_manifest
    from megarl.checkpoint.train_state import load_train_state, own_files, save_train_state
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
    model = ModelConfig(hf_config=args.model)
    state = build_train_state(model, OptimizerConfig(), groups, 4)
    supervised.train_step(supervised.engine(state), supervised.dp_shard(reverse_digits_batch(0, 8, 4, seed=0), groups),
                          MicroBatching(2))  # fills Adam's moments
    fresh = build_train_state(model, OptimizerConfig(), groups, 4)
    queue = AsyncCallsQueue()
    keys = ("blocked", "saved", "load", "sizes", "hashed", "rank_hash", "merged")
    timings = {mode: {"mb": 0.0, **{key: [] for key in keys}} for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            path = Path(args.work) / f"{mode}-{repeat}"
            dist.barrier()
            start = time.perf_counter()
            save_train_state(state, path, mode.split("+")[0], async_queue=queue if "async" in mode else None,
                             hash_files=False)
            blocked = time.perf_counter() - start
            queue.maybe_finalize_async_calls(blocking=True)
            dist.barrier()
            saved = time.perf_counter() - start
            if dist.get_rank() == 0:  # the driver's commit, after the files are complete
                for key, hashes in (("sizes", False), ("hashed", True)):
                    begin = time.perf_counter()
                    write_manifest(path, hashes=hashes)
                    timings[mode][key].append(time.perf_counter() - begin)
            dist.barrier()
            begin = time.perf_counter()
            record_hashes(path, own_files(path, dist.get_rank()), dist.get_rank())
            slowest = torch.tensor([time.perf_counter() - begin])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            timings[mode]["rank_hash"].append(slowest.item())
            if dist.get_rank() == 0:
                begin = time.perf_counter()
                write_manifest(path)
                timings[mode]["merged"].append(time.perf_counter() - begin)
            dist.barrier()
            start = time.perf_counter()
            load_train_state(fresh, path)
            dist.barrier()
            t = timings[mode]
            t["load"].append(time.perf_counter() - start)
            t["blocked"].append(blocked)
            t["saved"].append(saved)
            t["mb"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
            if dist.get_rank() == 0:
                shutil.rmtree(path)
    if dist.get_rank() == 0:
        best = {m: {k: (min(v) if isinstance(v, list) else v) for k, v in t.items()} for m, t in timings.items()}
        params = sum(p.numel() for chunk in state.model for p in chunk.parameters()) * tp * pp
        print("RESULT " + json.dumps({"layout": args.layout, "world": tp * pp * dp, "params": params, "best": best}),
              flush=True)
    groups.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layout", default="1,1,2", help="t,p,d")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as work:
        config = Path(work) / "model.json"
        config.write_text(json.dumps(MODEL))
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
               __file__, "--worker", f"--layout={args.layout}", f"--repeats={args.repeats}", f"--model={config}",
               f"--work={work}"]
        out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    result = next(json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT "))
    best, base = result["best"], result["best"]["dp_reshardable"]
    print(f"training state of {result['params'] / 1e6:.1f}M parameters (fp32 + Adam), layout t,p,d={result['layout']}, "
          f"{result['world']} processes; best of {args.repeats}")
    print(f"{'format':>20s} {'blocked s':>10s} {'written s':>10s} {'load s':>8s} {'MB':>7s} "
          f"{'blocked/dp_r':>13s} {'load/dp_r':>10s} {'manifest s':>11s} | {'driver sha s':>12s} {'driver %':>9s} "
          f"| {'rank sha s':>10s} {'merge s':>8s} {'ranks %':>8s}")
    for mode in MODES:
        b = best[mode]
        driver = 100 * (b["hashed"] - b["sizes"]) / b["saved"]
        ranks = 100 * (b["rank_hash"] + b["merged"] - b["sizes"]) / b["saved"]
        print(f"{mode:>20s} {b['blocked']:10.2f} {b['saved']:10.2f} {b['load']:8.2f} {b['mb']:7.0f} "
              f"{b['blocked'] / base['blocked']:13.2f} {b['load'] / base['load']:10.2f} {b['sizes']:11.3f} | "
              f"{b['hashed']:12.3f} {driver:9.1f} | {b['rank_hash']:10.3f} {b['merged']:8.3f} {ranks:8.1f}")

if __name__ == "__main__":
    main()
