"""Conversion throughput and memory: HF -> Megatron and back for a model of a few hundred MB,
at world sizes 1, 2 and 4, side by side in one run.

    python benchmarks/convert.py [--hidden 768 --layers 8 --vocab 32000]

Prints, per direction and world size: wall seconds, seconds per GB of weights, and per rank the
peak resident memory (ru_maxrss) and its growth over the process's size before converting, to
show that no rank holds the whole model. Layouts: world 2 splits layers (pp=2), world 4 uses
tp=2 x pp=2 for HF -> Megatron; Megatron -> HF splits layers over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {1: (1, 1), 2: (1, 2), 4: (2, 2)}  # world -> (tp, pp)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(args) -> None:
    import torch

    from megarl.checkpoint.convert import hf_to_mcore, mcore_to_hf
    from megarl.config import ParallelConfig
    from megarl.runtime import init_distributed

    init_distributed()
    before = _rss_mb()
    start = time.perf_counter()
    if args.direction == "hf-to-mcore":
        tp, pp = LAYOUTS[torch.distributed.get_world_size()]
        hf_to_mcore(args.src, args.dst, ParallelConfig(tp=tp, pp=pp))
    else:
        mcore_to_hf(args.src, args.dst)
    seconds = time.perf_counter() - start
    record = {"rank": torch.distributed.get_rank(), "seconds": seconds, "rss_before_mb": before, "rss_peak_mb": _rss_mb()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, record)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)


def make_model(path: Path, args) -> float:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="200MB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9


def run(direction: str, world: int, src: Path, dst: Path) -> list:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--direction", direction, "--src", str(src), "--dst", str(dst)]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not found:
        sys.exit(f"{direction} at world {world} failed:\n{out.stderr[-3000:]}")
    return [dict(r, wall=wall) for r in found[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--direction", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.direction:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="megarl-convert-bench-"))
    try:
        gb = make_model(work / "hf", args)
        print(f"model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"{gb * 1000:.0f} MB of fp32 safetensors")
        print(f"{'direction':>12} {'world':>5} {'wall s':>7} {'s/GB':>6}  per rank: peak RSS MB (growth while converting)")
        for world in args.worlds:
            mc, rt = work / f"mc{world}", work / f"rt{world}"
            for direction, src, dst in (("hf-to-mcore", work / "hf", mc), ("mcore-to-hf", mc, rt)):
                ranks = run(direction, world, src, dst)
                wall = ranks[0]["wall"]
                per_rank = ", ".join(f"{r['rss_peak_mb']:.0f} (+{r['rss_peak_mb'] - r['rss_before_mb']:.0f})" for r in ranks)
                print(f"{direction:>12} {world:>5} {wall:7.1f} {wall / gb:6.1f}  {per_rank}")
            shutil.rmtree(mc)
            shutil.rmtree(rt)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
