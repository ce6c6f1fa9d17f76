"""3D-HybridEngine: training → generation weight resharding, micro-DP against full all-gather,
and delta against full weight sync.

    python benchmarks/reshard.py            # measured runs (4 and 8 CPU processes) + paper-scale table
    python benchmarks/reshard.py table      # the paper-scale table only (planner, no tensors)
    python benchmarks/reshard.py delta      # weight_sync=delta vs full while training, + extrapolation

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


# ---------------------------------------------------------------- delta against full, while training
DELTA_STEPS = 20
DELTA_LRS = (1e-6, 1e-5)
ROLLOUT_ITEMSIZE = 2  # bf16 rollout


def bf16_change_model(tensors, lr: float) -> float:
    """The cost model's fraction of elements whose bf16 value changes in one step: each moves by
    ``lr`` (Adam's step at its largest: lr times m/sqrt(v), at most about 1), which crosses a
    rounding boundary of its bf16 value with probability lr / ulp(w), ulp(w) = 2^(floor(log2|w|) - 7)."""
    import torch

    changed, total = 0.0, 0
    for t in tensors:
        w = t.detach().float().reshape(-1).abs()
        ulp = torch.exp2(torch.floor(torch.log2(w.clamp_min(1e-38))) - 7)
        changed += torch.clamp(lr / ulp, max=1.0).sum().item()
        total += w.numel()
    return changed / total


def encodings(new, old) -> dict:
    """Sizes (fraction of dense) and encode seconds of each delta encoding, and of xor + zlib
    (level 1), on one message: the encoding's justification."""
    import time
    import zlib

    import torch

    from megarl.hybrid import delta as deltas

    out = {}
    deltas.encode(new[:64], old[:64], force=deltas.Encoding.gaps)  # numba compiles (or loads) its kernels first
    for kind in deltas.Encoding:
        if kind == deltas.Encoding.dense:
            continue
        start = time.perf_counter()
        message = deltas.encode(new, old, force=kind)
        out[kind.name] = (message.payload.numel() / (new.numel() * new.element_size()), time.perf_counter() - start)
    start = time.perf_counter()
    xor = (new.view(torch.int16) ^ old.view(torch.int16)).numpy().tobytes()
    packed = zlib.compress(xor, 1)
    out["xor+zlib"] = (len(packed) / len(xor), time.perf_counter() - start)
    return out


def delta_worker(args) -> None:
    """torchrun, 4 ranks: the actor trains (tp=2, dp=2, Megatron's optimizer, PPO loss on random
    tokens) and after every step four syncs run, each timed between barriers: colocated (the
    micro-DP resharder to t_g=1 on the same ranks) and split (ranks 0-1, the first replica's
    tensor-parallel pair, send point to point into ranks 2-3's own bf16 tensors), full and delta."""
    import socket
    import time

    import torch
    import torch.distributed as dist

    from megarl.config import ModelConfig, OptimizerConfig
    from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
    from megarl.engines.train_state import build_train_state
    from megarl.hybrid import ModelSpec, Resharder, regroup
    from megarl.hybrid.names import planned_tensors
    from megarl.hybrid.transfer import ShardReceiver, ShardSender, connect, plan_transfer
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel import Layout, build_groups
    from megarl.roles.actor import Actor, ActorLossConfig
    from megarl.runtime import init_distributed, set_seed

    init_distributed()
    rank, bucket = dist.get_rank(), args.bucket_mb << 20
    for name in args.models:
        path = Path(args.work) / f"{name}.json"
        margs = megatron_args_from_hf(path)
        model = ModelSpec.from_args(margs)
        for lr in DELTA_LRS:
            layout = Layout(tp=2, dp=2)
            groups = build_groups(layout)
            set_seed(11, groups)
            state = build_train_state(ModelConfig(hf_config=str(path)), OptimizerConfig(lr=lr, clip_grad=1.0), groups,
                                      DELTA_STEPS)
            actor = Actor(MegatronEngine(state, margs.vocab_size), ActorLossConfig(agg_mode="seq-mean-token-mean"))
            gen = torch.Generator().manual_seed(100 + rank // 2)
            rows, seq = 8, 64
            tokens = torch.randint(3, margs.vocab_size, (rows, seq + 1), generator=gen)
            batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                     "loss_mask": torch.ones(rows, seq), "position_ids": torch.arange(seq).expand(rows, -1).contiguous(),
                     "old_log_probs": torch.full((rows, seq), -9.0),
                     "advantages": torch.randn(rows, 1, generator=gen).expand(-1, seq).contiguous()}
            lengths = torch.full((rows,), seq)
            rg = regroup(layout, 1, 1, 1, model.num_experts)
            colocated = {mode: Resharder.create(model, rg, state.model, bucket, out_dtype=torch.bfloat16,
                                                delta=mode == "delta") for mode in ("full", "delta")}
            port = [0]
            if rank == 0:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port[0] = sock.getsockname()[1]
            dist.broadcast_object_list(port, src=0)
            group = connect("127.0.0.1", port[0], rank, 4)
            split = {}
            for mode in ("full", "delta"):
                plan = plan_transfer(model, Layout(tp=2), Layout(tp=1, dp=2), bucket // 4 // 2, delta=mode == "delta")
                split[mode] = ShardSender(plan, rank, state.model) if rank < 2 else ShardReceiver(
                    plan, rank - 2, {t.name: torch.empty(t.shape, dtype=torch.bfloat16) for t in plan.shards[rank - 2]})
                split[mode].connect(group)
            weights = [t for c in state.model for t in planned_tensors(c).values()]
            predicted = {lr: bf16_change_model(weights, lr)}
            rows_out, previous = [], None
            for step in range(DELTA_STEPS + 1):
                if step:
                    actor.update(batch, lengths, MicroBatching(1))
                if rank == 0 and lr == DELTA_LRS[0]:  # this rank's whole shard, one step against the last
                    flat = torch.cat([t.detach().reshape(-1) for t in weights]).to(torch.bfloat16)
                    if step in (1, DELTA_STEPS):
                        rows_out.append({"encodings": encodings(flat, previous), "step": step})
                    previous = flat
                record = {"step": step}
                for placement, sides in (("colocated", colocated), ("split", split)):
                    for mode, side in sides.items():
                        dist.barrier()
                        start = time.perf_counter()
                        side.sync()
                        dist.barrier()
                        seconds = time.perf_counter() - start
                        s = side.last
                        record[f"{placement}/{mode}"] = {"seconds": seconds, "received": s.bytes_received,
                                                         "dense": s.dense_received, "peak": s.peak_extra_bytes,
                                                         "copy": s.delta_copy_bytes, "changed": s.elements_changed}
                rows_out.append(record)
            everything = [None] * dist.get_world_size()
            dist.all_gather_object(everything, rows_out)
            if rank == 0:
                print("RESULT " + json.dumps({"model": name, "lr": lr, "ranks": everything, "predicted": predicted[lr],
                                              "params": model.numel(), "bucket": bucket}), flush=True)
            del colocated, split, state, actor, group
            groups.destroy()


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


def delta_report(result: dict) -> dict:
    """Per step: bytes each placement's rollout ranks received (summed), full vs delta, and the
    slowest sync; then the summary row (steps after the first) the README quotes."""
    steps = len(result["ranks"][0]) - sum(1 for r in result["ranks"][0] if "encodings" in r)
    per_step = []
    for i in range(steps):
        records = [[r for r in ranks if "encodings" not in r][i] for ranks in result["ranks"]]
        row = {"step": records[0]["step"]}
        for key in ("colocated/full", "colocated/delta", "split/full", "split/delta"):
            row[key] = {"received": sum(r[key]["received"] for r in records),
                        "dense": sum(r[key]["dense"] for r in records),
                        "seconds": records[0][key]["seconds"],
                        "peak": max(r[key]["peak"] for r in records), "copy": max(r[key]["copy"] for r in records)}
        receivers = records[2:]  # split: ranks 2-3 receive their generation shards
        changed = sum(r["split/delta"]["changed"] for r in receivers)
        row["changed_fraction"] = changed / (sum(r["split/delta"]["dense"] for r in receivers) / ROLLOUT_ITEMSIZE)
        per_step.append(row)
    print(f"\n{result['model']} ({result['params'] / 1e6:.1f} M parameters), lr {result['lr']:g}, bf16 rollout, "
          f"bucket {result['bucket'] >> 20} MiB; cost model: {100 * result['predicted']:.2f}% of elements change per step")
    print(f"{'step':>4s} {'changed':>8s} {'colo full MB':>12s} {'colo delta':>10s} {'ratio':>6s} {'colo s f/d':>12s} "
          f"{'split full MB':>13s} {'split delta':>11s} {'ratio':>6s} {'split s f/d':>13s}")
    for row in per_step:
        cf, cd, sf, sd = (row[k] for k in ("colocated/full", "colocated/delta", "split/full", "split/delta"))
        print(f"{row['step']:4d} {100 * row['changed_fraction']:7.2f}% {mb(cf['received'])}     {mb(cd['received'])} "
              f"{cd['received'] / cf['received']:6.3f} {cf['seconds']:6.3f}/{cd['seconds']:.3f} "
              f"{mb(sf['received'])}      {mb(sd['received'])} {sd['received'] / sf['received']:6.3f} "
              f"{sf['seconds']:6.3f}/{sd['seconds']:.3f}")
    later = per_step[1:]
    summary = {"model": result["model"], "lr": result["lr"], "predicted_change": result["predicted"],
               "measured_change": sum(r["changed_fraction"] for r in later) / len(later),
               "bucket_mb": result["bucket"] >> 20}
    for key in ("colocated", "split"):
        full, delta = ([r[f"{key}/{m}"] for r in later] for m in ("full", "delta"))
        summary[key] = {"bytes_ratio_mean": sum(d["received"] / f["received"] for f, d in zip(full, delta)) / len(later),
                        "bytes_ratio_max": max(d["received"] / f["received"] for f, d in zip(full, delta)),
                        "seconds_full": sorted(f["seconds"] for f in full)[len(full) // 2],
                        "seconds_delta": sorted(d["seconds"] for d in delta)[len(delta) // 2],
                        "peak_full_mb": max(f["peak"] for f in full) / 2**20,
                        "peak_delta_mb": max(d["peak"] for d in delta) / 2**20,
                        "copy_mb": max(d["copy"] for d in delta) / 2**20}
    for key in ("colocated", "split"):
        s = summary[key]
        print(f"{key}: delta/full bytes mean {s['bytes_ratio_mean']:.3f} (max {s['bytes_ratio_max']:.3f}); median sync "
              f"{s['seconds_full']:.3f} s full, {s['seconds_delta']:.3f} s delta (x{s['seconds_full'] / s['seconds_delta']:.2f}); "
              f"peak extra {s['peak_full_mb']:.1f} / {s['peak_delta_mb']:.1f} MiB (full / delta) against a "
              f"{summary['bucket_mb']} MiB bucket; sender's copy {s['copy_mb']:.1f} MiB")
    print(f"changed elements per step: measured {100 * summary['measured_change']:.2f}%, cost model "
          f"{100 * summary['predicted_change']:.2f}% (an upper bound: Adam's step is at most about lr)")
    for r in (r for ranks in result["ranks"][:1] for r in ranks if "encodings" in r):
        cells = ", ".join(f"{k} {100 * size:.1f}% in {sec * 1e3:.0f} ms" for k, (size, sec) in r["encodings"].items())
        print(f"encodings of rank 0's bf16 shard at step {r['step']} (size of dense, encode time): {cells}")
    return summary


# Published layouts the extrapolation uses (read 2026-12 from the repositories named).
SCALE = [
    # model, source, placement, training (t, p), rollout GPUs per engine (t_g), GPUs
    ("llama3-70b", "NeMo-RL examples/configs/grpo_math_70B_megatron.yaml", "colocated", (4, 4), 8, 64),
    ("qwen3-235b-a22b", "verl examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh", "colocated", (4, 8), 8, 32),
    ("llama3-70b", "NeMo-RL grpo_math_70B_megatron.yaml, rollout on 64 GPUs of its own", "split", (4, 4), 8, 128),
    ("qwen3-235b-a22b", "slime scripts/run-qwen3-235B-A22B.sh (64 + 64 GPUs, engines of 32)", "split", (4, 4), 32, 128),
]
HBM_GBPS = 2000.0  # effective GPU memory bandwidth of the delta's tensor ops
DELTA_HBM_BYTES = 16  # HBM traffic per element of encode + apply (compare, mask, positions, copy back)
WEIGHT_STD = 0.02  # the weights' spread the cost model assumes at scale (LLM weights: 0.01-0.03)


def bytes_ratio(change: float) -> float:
    """Delta bytes over full's for a bf16 message with ``change`` of its elements changed (the
    smallest encoding; escapes neglected above 1/255)."""
    return min(1.0, change * (1 + ROLLOUT_ITEMSIZE) / ROLLOUT_ITEMSIZE, 1 / 16 + change)


def extrapolate(summaries) -> None:
    """The cost model at the published layouts: bytes into each generation GPU per sync, full and
    delta, and the time at the link's bandwidth (plus the delta's GPU work)."""
    import torch

    from megarl.hybrid import ModelSpec
    from megarl.models.hf_config import megatron_args_from_hf

    sample = [torch.randn(10_000_000, generator=torch.Generator().manual_seed(0)) * WEIGHT_STD]
    print(f"\nCost model, checked against the runs above (bytes of delta over full, after the first sync):")
    for s in summaries:
        print(f"  {s['model']:6s} lr {s['lr']:g}: predicted change {100 * s['predicted_change']:.2f}% -> bytes "
              f"x{bytes_ratio(s['predicted_change']):.3f}; measured change {100 * s['measured_change']:.2f}% -> "
              f"x{bytes_ratio(s['measured_change']):.3f} by the formula, x{s['split']['bytes_ratio_mean']:.3f} sent "
              f"(split), x{s['colocated']['bytes_ratio_mean']:.3f} (colocated)")
    print(f"\nExtrapolation (bf16; weights ~ N(0, {WEIGHT_STD}^2); split: InfiniBand {IB_GBPS:.0f} GB/s into each "
          f"generation GPU, each receiving its 1/t_g of the model; colocated: HybridFlow's micro-DP bytes over NVLink "
          f"{NVLINK_GBPS:.0f} GB/s; delta adds {DELTA_HBM_BYTES} bytes of HBM traffic per element at {HBM_GBPS:.0f} GB/s):")
    print(f"{'model':16s} {'placement':>9s} {'GPUs':>5s} {'t,p':>5s} {'t_g':>4s} {'lr':>6s} {'change':>7s} "
          f"{'full GB':>8s} {'full s':>7s} {'delta GB':>9s} {'delta s':>8s} {'speed-up':>8s}  source")
    for name, source, placement, (t, p), t_g, gpus in SCALE:
        model = ModelSpec.from_args(megatron_args_from_hf(ROOT / "configs/models/reference" / f"{name}.json"))
        params = model.numel()
        for lr in DELTA_LRS:
            change = bf16_change_model(sample, lr)
            if placement == "split":
                elems = params / t_g
                full = elems * ROLLOUT_ITEMSIZE
                link = IB_GBPS
            else:
                elems = params / t_g  # the generation shard each GPU rebuilds
                full = params * ROLLOUT_ITEMSIZE * (t * p - t_g) / (t_g * t * p)
                link = NVLINK_GBPS
            full_s = full / (link * 1e9)
            delta = full * bytes_ratio(change)
            delta_s = delta / (link * 1e9) + elems * DELTA_HBM_BYTES / (HBM_GBPS * 1e9)
            print(f"{name:16s} {placement:>9s} {gpus:5d} {f'{t},{p}':>5s} {t_g:4d} {lr:6.0e} {100 * change:6.2f}% "
                  f"{full / 1e9:8.2f} {full_s:7.2f} {delta / 1e9:9.2f} {delta_s:8.2f} {full_s / delta_s:7.1f}x  {source}")


def measured_delta(args) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    summaries = []
    with tempfile.TemporaryDirectory() as work:
        for name, config in (("dense", DENSE), ("moe", MOE)):
            (Path(work) / f"{name}.json").write_text(json.dumps(config))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", __file__,
               "delta-worker", "--work", work, "--bucket-mb", str(args.bucket_mb), "--models", *args.models]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                summaries.append(delta_report(json.loads(line[7:])))
    extrapolate(summaries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "table", "worker", "delta", "delta-worker"])
    parser.add_argument("--models", nargs="*", default=["dense", "moe"])
    parser.add_argument("--pairs", nargs="*", default=[])
    parser.add_argument("--work", default="")
    parser.add_argument("--bucket-mb", type=int, default=32)
    args = parser.parse_args()
    if args.what == "worker":
        worker(args)
        return
    if args.what == "delta-worker":
        delta_worker(args)
        return
    if args.what == "delta":
        measured_delta(args)
        return
    if args.what == "all":
        measured(args)
    table()


if __name__ == "__main__":
    main()
