"""3D-HybridEngine: training → generation weight resharding, micro-DP against full all-gather.

    python benchmarks/reshard.py            # measured runs (4 and 8 CPU processes) + paper-scale table
    python benchmarks/reshard.py table      # the paper-scale table only (planner, no tensors)

Measured: each layout pair runs under torchrun on this machine (gloo on CPU, NCCL on GPUs); per
rank it prints bytes received and sent (counted where buffers enter the transport), peak extra
memory (send/receive buffers, plus the gathered model for full_gather) and the wall time of one
sync, for ``micro_dp`` and ``full_gather`` side by side, with HybridFlow's Table 2 value and the
ratios. Paper scale: the same planner on real model shapes (bf16) reports per-rank bytes, peak
weight memory and an estimated transition time at the stated bandwidths.
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

# Benchmark models: big enough that moving bytes dominates (fp32 on CPU: ~140 MB dense, ~110 MB MoE).
DENSE = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192, "max_position_embeddings": 512}
MOE = {"model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1408, "moe_intermediate_size": 256,
       "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
       "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 8192, "max_position_embeddings": 512}
PAIRS = {  # world size -> model@t,p,d,e>t_g,p_g,e_g
    4: ["dense@4,1,1,1>2,1,1", "dense@2,2,1,1>2,1,1", "dense@2,2,1,1>1,1,1", "moe@2,1,2,2>1,1,1",
        "moe@2,1,2,2>1,1,2", "moe@1,1,4,4>1,1,4", "moe@2,2,1,1>1,1,2"],
    8: ["dense@4,2,1,1>2,1,1", "dense@8,1,1,1>2,1,1", "moe@2,1,4,4>1,1,4", "moe@2,1,4,4>2,1,2"],
}
SYNCS = 3

# Paper scale: (model, GPUs, training t,p,d,e, generation t_g,p_g,e_g).
PAPER = [
    ("llama2-7b", 8, (4, 1, 2, 1), (2, 1, 1)),
    ("llama2-7b", 64, (4, 2, 8, 1), (2, 1, 1)),
    ("llama2-7b", 256, (8, 1, 32, 1), (2, 1, 1)),
    ("llama3-70b", 64, (8, 4, 2, 1), (4, 1, 1)),
    ("llama3-70b", 256, (8, 4, 8, 1), (8, 1, 1)),
    ("llama3-70b", 1024, (8, 8, 16, 1), (8, 1, 1)),
    ("qwen3-30b-a3b", 32, (4, 2, 4, 8), (2, 1, 1)),
    ("qwen3-30b-a3b", 128, (4, 2, 16, 8), (4, 1, 8)),
    ("deepseek-v3", 256, (8, 8, 4, 32), (8, 2, 16)),
    ("deepseek-v3", 1024, (8, 16, 8, 64), (8, 2, 32)),
]
BYTES_PER_PARAM = 2  # bf16
GPUS_PER_NODE = 8
NVLINK_GBPS = 450.0  # per GPU, one direction (H100 NVLink 4)
IB_GBPS = 50.0  # per GPU (one 400 Gb/s NDR NIC per GPU)
BUCKET_GB = 0.5


def parse_pair(pair: str):
    name, rest = pair.split("@")
    train, gen = rest.split(">")
    return name, tuple(int(x) for x in train.split(",")), tuple(int(x) for x in gen.split(","))


def worker(args) -> None:
    import time

    import torch
    import torch.distributed as dist

    from megarl.config import ModelConfig
    from megarl.hybrid import ModelSpec, Resharder, regroup
    from megarl.models import build_model
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout, build_groups
    from megarl.runtime import init_distributed

    init_distributed()
    for pair in args.pairs:
        name, (t, p, d, e), (t_g, p_g, e_g) = parse_pair(pair)
        path = Path(args.work) / f"{name}.json"
        layout = Layout(tp=t, pp=p, dp=d, ep=e, etp=1 if e > 1 else None)
        groups = build_groups(layout)
        margs = megatron_args_from_hf(path)
        chunks = build_model(ModelConfig(hf_config=str(path)), groups, margs, initialize=False)
        model = ModelSpec.from_args(margs)
        rg = regroup(layout, t_g, p_g, e_g, model.num_experts)
        rows = []
        for mode in ("micro_dp", "full_gather"):
            resharder = Resharder.create(model, rg, chunks, bucket_bytes=args.bucket_mb << 20, mode=mode)
            resharder.sync()  # warm-up: allocations, first messages
            seconds = []
            for _ in range(SYNCS):
                dist.barrier()
                start = time.perf_counter()
                resharder.sync()
                dist.barrier()
                seconds.append(time.perf_counter() - start)
            s = resharder.last
            rows.append({"mode": mode, "rank": dist.get_rank(), "received": s.bytes_received, "sent": s.bytes_sent,
                         "peak_extra": s.peak_extra_bytes, "seconds": min(seconds)})
            del resharder
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, rows)
        if dist.get_rank() == 0:
            itemsize = next(chunks[0].parameters()).element_size()
            print("RESULT " + json.dumps({"pair": pair, "rows": [r for rs in everything for r in rs],
                                          "model_bytes": model.numel() * itemsize}), flush=True)
        groups.destroy()
        del chunks


def mb(x: float) -> str:
    return f"{x / 2**20:8.1f}"


def report(result: dict) -> None:
    from megarl.hybrid import hybridflow_bytes

    name, (t, p, d, e), (t_g, p_g, e_g) = parse_pair(result["pair"])
    formula = hybridflow_bytes(t, p, t_g, p_g, result["model_bytes"])
    dense = "" if name == "dense" else " (dense formula; experts under e_g > 1 move less)"
    print(f"\n{result['pair']}  (model {mb(result['model_bytes']).strip()} MB; HybridFlow per rank{dense}: micro-DP "
          f"{mb(formula['micro_dp_received']).strip()} MB, full all-gather {mb(formula['full_gather_received']).strip()} MB)")
    print(f"{'mode':12s} {'rank':>4s} {'recv MB':>8s} {'sent MB':>8s} {'peak MB':>8s} {'sync s':>8s}")
    rows = sorted(result["rows"], key=lambda r: (r["mode"] != "micro_dp", r["rank"]))
    for r in rows:
        print(f"{r['mode']:12s} {r['rank']:4d} {mb(r['received'])} {mb(r['sent'])} {mb(r['peak_extra'])} {r['seconds']:8.3f}")
    by = {m: [r for r in rows if r["mode"] == m] for m in ("micro_dp", "full_gather")}
    worst = {m: max(r["seconds"] for r in by[m]) for m in by}
    recv = {m: max(r["received"] for r in by[m]) for m in by}
    peak = {m: max(r["peak_extra"] for r in by[m]) for m in by}
    ratio = lambda a, b: f"x{a / b:.2f}" if b else f"{mb(a).strip()} MB vs none"  # e_g = ep: nothing moves
    print(f"full_gather / micro_dp: time x{worst['full_gather'] / worst['micro_dp']:.2f}, "
          f"bytes received {ratio(recv['full_gather'], recv['micro_dp'])}, "
          f"peak extra memory {ratio(peak['full_gather'], peak['micro_dp'])}")


def measured(args) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as work:
        for name, config in (("dense", DENSE), ("moe", MOE)):
            (Path(work) / f"{name}.json").write_text(json.dumps(config))
        for world, pairs in PAIRS.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   __file__, "worker", "--work", work, "--bucket-mb", str(args.bucket_mb), "--pairs", *pairs]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    report(json.loads(line[7:]))


def table() -> None:
    from megarl.hybrid import ModelSpec, rank_traffic, regroup
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout

    gb = 1e9
    print(f"\nPaper scale (planner only; bf16; {GPUS_PER_NODE} GPUs/node; NVLink {NVLINK_GBPS:.0f} GB/s and "
          f"InfiniBand {IB_GBPS:.0f} GB/s per GPU; transition = same-node bytes / NVLink + other-node bytes / IB, "
          f"no overlap; peak = weights held for generation + one {BUCKET_GB} GB bucket). Rank 0 shown.")
    print(f"{'model':14s} {'GPUs':>5s} {'train t,p,d,e':>14s} {'gen t,p,e':>10s} {'mode':>11s} {'recv GB':>8s} "
          f"{'(other node)':>12s} {'peak GB':>8s} {'est. s':>7s}")
    for name, gpus, (t, p, d, e), gen in PAPER:
        model = ModelSpec.from_args(megatron_args_from_hf(ROOT / "configs/models/reference" / f"{name}.json"))
        layout = Layout(tp=t, pp=p, dp=d, ep=e, etp=1 if e > 1 else None)
        assert layout.world_size == gpus, (name, gpus)
        rg = regroup(layout, *gen, model.num_experts)
        for mode in ("micro_dp", "full_gather"):
            tr = rank_traffic(model, rg, 0, mode, GPUS_PER_NODE)
            recv = tr["received"] * BYTES_PER_PARAM
            other = tr["received_other_nodes"] * BYTES_PER_PARAM
            est = (recv - other) / (NVLINK_GBPS * gb) + other / (IB_GBPS * gb)
            peak = tr["assembled"] * BYTES_PER_PARAM / gb + BUCKET_GB
            print(f"{name:14s} {gpus:5d} {f'{t},{p},{d},{e}':>14s} {','.join(map(str, gen)):>10s} {mode:>11s} "
                  f"{recv / gb:8.2f} {other / gb:12.2f} {peak:8.1f} {est:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "table", "worker"])
    parser.add_argument("--pairs", nargs="*", default=[])
    parser.add_argument("--work", default="")
    parser.add_argument("--bucket-mb", type=int, default=32)
    args = parser.parse_args()
    if args.what == "worker":
        worker(args)
        return
    if args.what == "all":
        measured(args)
    table()


if __name__ == "__main__":
    main()
