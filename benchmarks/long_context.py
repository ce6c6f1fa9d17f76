"""Long sequences: memory per rank and step time against sequence length, context parallelism
and activation recompute, side by side in one run.

    python benchmarks/long_context.py [--lengths 512 1024 2048 4096 8192] [--cps 1 2 4]
        [--recompute none selective full] [--repeats 1]

For each cp (world = cp; tp = pp = dp = 1) one torchrun session trains a small Llama (hidden 256,
4 layers, vocab 4096, fp32) through megarl's real path (``build_train_state`` and
``supervised.train_step``: Megatron DDP, distributed optimizer, the SDPA core attention's context
parallelism) on one batch row of each length, at each recompute setting. Each recompute
setting builds the model once and takes one warm-up step at the shortest length (Adam allocates
its state), then ``--repeats`` timed steps (forward+backward+optimizer) at each length in turn.
Per rank, max over ranks (resident set size on CPU, torch's CUDA allocation on GPUs):

* step memory: the peak during a step minus the memory just before it (weights, gradient
  buffers and Adam state are already there): activations, logits, communication and optimizer
  temporaries; max over the timed steps. This is what should fall about 1/cp;
* state memory: what building the model and its first step kept (weights, gradient buffers,
  Adam state, which the distributed optimizer shards over cp; the first setting of a process
  also keeps megatron-core's one-time allocations);
* peak memory: the process before any model (Python, torch, megatron-core) + state + step;
* step time: the fastest timed step (ranks synchronised before and after).

The loss of the first step at each length is printed too: the same initial weights, tokens and
updates at every cp, so it must agree across cp (a check of the CP path at lengths the parity
tests do not reach).

The workers run with glibc's mmap threshold fixed at 64 KiB so that freed tensors go back to
the OS: otherwise memory freed by one step is reused by the next from the heap and the step's
growth reads too low (measured at 1024 tokens: 53 MB, against 120 MB with the fixed threshold).
The price is a page fault per fresh page, which made steps ~40% slower at 512-1024 tokens: step
times here compare cp and recompute settings; ``benchmarks/train_step.py`` measures throughput.
Each process has one thread (OMP_NUM_THREADS=1). On a machine with fewer cores than cp (cp=4
on 2 cores) the ranks share cores: memory is the point there, step times are not scaling figures.
With ``--repeats 2`` the default grid took 7.5 minutes on 2 shared cores; the default (1) about 5.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
         "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
LENGTHS = [512, 1024, 2048, 4096, 8192]
CPS = [1, 2, 4]
RECOMPUTE = ["none", "selective", "full"]
SEED = 0


def batch_row(length: int, vocab: int):
    """One row of ``length`` random tokens, every position trained on."""
    import torch

    gen = torch.Generator().manual_seed(SEED + length)
    tokens = torch.randint(3, vocab, (1, length + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(1, length), "position_ids": torch.arange(length).unsqueeze(0)}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megarl.config import ModelConfig, OptimizerConfig
    from megarl.engines import supervised
    from megarl.engines.megatron_engine import MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.parallel import Layout, build_groups
    from megarl.runtime import init_distributed, set_seed
    from megarl.runtime.memory import reset_peak_memory, window_peaks_gb

    init_distributed()
    groups = build_groups(Layout(cp=dist.get_world_size()))

    def now() -> float:
        """This rank's memory now (GB): a reset high-water mark equals the current size."""
        reset_peak_memory()
        return window_peaks_gb()[kind]

    kind = "gpu" if torch.cuda.is_available() else "host"
    process = now()  # Python, torch, megatron-core, process groups
    batches = {length: batch_row(length, MODEL["vocab_size"]) for length in args.lengths}
    for recompute in args.recompute:
        set_seed(SEED, groups)
        empty = now()
        model_cfg = ModelConfig(hf_config=args.model, recompute_granularity=None if recompute == "none" else recompute)
        state = build_train_state(model_cfg, OptimizerConfig(lr=1e-5), groups, 1 + len(batches) * args.repeats)
        engine, how = supervised.engine(state), MicroBatching(1)
        supervised.train_step(engine, batches[min(batches)], how)  # warm-up: Adam allocates its state
        gc.collect()
        kept = now() - empty  # weights, gradient buffers, Adam state
        for length, batch in batches.items():
            growth, seconds, losses = 0.0, [], []
            for _ in range(args.repeats):
                gc.collect()
                dist.barrier()
                before = now()
                start = time.perf_counter()
                losses.append(supervised.train_step(engine, batch, how)["loss"])
                dist.barrier()
                seconds.append(time.perf_counter() - start)
                growth = max(growth, window_peaks_gb()[kind] - before)
            mine = torch.tensor([growth, kept, process])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"length": length, "cp": groups.layout.cp, "recompute": recompute,
                                              "step_s": min(seconds), "step_gb": mine[0].item(),
                                              "state_gb": mine[1].item(), "process_gb": mine[2].item(),
                                              "loss": losses[0], "memory": kind}), flush=True)
        # Megatron's DDP is kept alive by its own gradient hooks (a reference cycle through
        # autograd nodes that gc does not see): the next setting measures from above it.
        del state
    groups.destroy()


def launch(args, cp: int, model: Path) -> list:
    """Run this file's worker under torchrun with ``cp`` processes; its RESULT records."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_="65536")  # see the docstring: freed tensors leave the RSS
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), __file__,
           "worker", "--model", str(model), "--repeats", str(args.repeats),
           "--lengths", *map(str, args.lengths), "--recompute", *args.recompute]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"cp={cp} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="all", choices=["all", "worker"])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="tokens per sequence")
    parser.add_argument("--cps", type=int, nargs="+", default=CPS, help="context-parallel sizes (= processes)")
    parser.add_argument("--recompute", nargs="+", default=RECOMPUTE, choices=RECOMPUTE)
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per length and setting (fastest kept)")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what == "worker":
        return worker(args)
    if any(cp < 1 for cp in args.cps) or args.repeats < 1:
        parser.error("--cps and --repeats must be positive")
    step = 2 * max(args.cps)  # CP cuts each sequence into 2·cp equal chunks
    if any(length < step or length % step for length in args.lengths):
        parser.error(f"--lengths must be positive multiples of 2*max(--cps) = {step}: got {args.lengths}")
    with tempfile.TemporaryDirectory() as work:
        model = Path(work) / "llama.json"
        model.write_text(json.dumps(MODEL | {"max_position_embeddings": max(8192, *args.lengths)}))
        rows = [row for cp in args.cps for row in launch(args, cp, model)]
    print(f"Llama hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}, "
          f"fp32; one sequence per step; world = cp; {os.cpu_count()} CPU cores, one thread per process")
    if max(args.cps) > (os.cpu_count() or 1):
        print(f"cp={max(args.cps)} runs more processes than cores: its step times share cores (memory is the point)")
    memory = rows[0]["memory"]
    for cp in args.cps:
        process = max(r["process_gb"] for r in rows if r["cp"] == cp)
        print(f"cp={cp}: {process * 1024:.0f} MB of {memory} memory per rank before any model "
              "(Python, torch, megatron-core)")
    print("per rank, max over ranks. state MB: weights, gradient buffers, Adam state (sharded over cp)\n"
          "step MB: peak in a training step minus the memory before it (activations, logits, temporaries)\n"
          "x cp=1: step MB against cp=1 at the same length and recompute (ideal 1/cp)\n"
          "peak MB: process + state + step; loss: first step at the length, equal across cp")
    print(f"{'length':>6} {'cp':>3} {'recompute':>9} {'step s':>8} {'tokens/s':>9} {'state MB':>8} {'step MB':>8} "
          f"{'x cp=1':>7} {'peak MB':>8} {'loss':>9}")
    base = {(r["length"], r["recompute"]): r["step_gb"] for r in rows if r["cp"] == 1}
    for r in sorted(rows, key=lambda r: (r["length"], RECOMPUTE.index(r["recompute"]), r["cp"])):
        ref = base.get((r["length"], r["recompute"]))
        ratio = f"{r['step_gb'] / ref:7.2f}" if ref else f"{'-':>7}"
        peak = r["process_gb"] + r["state_gb"] + r["step_gb"]
        print(f"{r['length']:6d} {r['cp']:3d} {r['recompute']:>9} {r['step_s']:8.3f} {r['length'] / r['step_s']:9.0f} "
              f"{r['state_gb'] * 1024:8.1f} {r['step_gb'] * 1024:8.1f} {ratio} {peak * 1024:8.0f} {r['loss']:9.5f}")

if __name__ == "__main__":
    main()
