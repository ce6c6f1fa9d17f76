"""Worker for test_delta_sync.py (torchrun, 4 processes). Prints ``RESULT {json}`` lines on rank 0.

Each case trains nothing real: the training shards are slices of a seeded random model, moved by
Adam-like steps (every element by +-lr, the sign a function of its own value, so that replicas
stay equal), and the real transports run between the real layouts:

- ``colocated``: world 4 in training layout tp=2, dp=2 (MoE: ep=2, etp=1), the micro-DP resharder
  to t_g=1 (and e_g=2 for MoE);
- ``split``: ranks 0-1 train (tp=2), ranks 2-3 are the rollout (t_g=1, d_g=2), the point-to-point
  sender and receiver over a spanning group.

A full sync and a delta sync run side by side after every step, into their own generation
tensors of the rollout's dtype; the case records whether they are bit-identical, the bytes each
received and the peak extra memory against the bucket (``moe64``: 64 experts, whose one layer
exceeds a small bucket).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.hybrid import ModelSpec, Resharder, regroup
from megarl.hybrid.planner import plan_reshard
from megarl.hybrid.transfer import ShardReceiver, ShardSender, connect, plan_transfer
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout
from megarl.runtime import init_distributed
from megarl.runtime.devices import compute_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEPS = 20
BUCKET = 256 << 10


def hf_config(name: str) -> dict:
    if name == "dense":
        return json.loads(Path("configs/models/tiny-llama.json").read_text()) | {"num_key_value_heads": 4}
    if name == "deepseek":  # its routers' expert_bias stays fp32 beside bf16 weights
        return json.loads(Path("configs/models/tiny-deepseek-v3.json").read_text())
    moe = json.loads(Path("configs/models/tiny-qwen3-moe.json").read_text())
    if name == "moe64":  # 64 experts: one layer's experts (1.5 MiB fp32) exceed the bucket
        moe |= {"num_local_experts": 64, "num_experts": 64, "num_hidden_layers": 2, "moe_intermediate_size": 64}
    return moe


def spec_of(name: str) -> ModelSpec:
    path = Path(os.environ["DELTA_WORK"]) / f"{name}.json"
    if dist.get_rank() == 0:
        path.write_text(json.dumps(hf_config(name)))
    dist.barrier()
    return ModelSpec.from_args(megatron_args_from_hf(str(path)))


def full_model(model: ModelSpec):
    """The same random fp32 weights on every rank (around 0.02, norms around 1)."""
    out = {}
    for i, spec in enumerate(model.tensors):
        g = torch.Generator().manual_seed(1000 + i)
        base = 1.0 if "norm" in spec.key else 0.0
        out[spec.key] = base + 0.02 * torch.randn(spec.shape, generator=g)
    return out


def chunk_of(model: ModelSpec, full, locals_) -> torch.nn.Module:
    """A module holding ``locals_`` (a rank's training tensors) under their local names."""
    root = torch.nn.Module()
    for local in locals_:
        spec = model.tensors[local.spec]
        data = torch.cat([full[spec.key].narrow(spec.split_dim, p.start, p.stop - p.start) for p in local.pieces],
                         spec.split_dim)
        *path, leaf = local.name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(data.clone().to(compute_device())))
    return root


@torch.no_grad()
def step(chunk: torch.nn.Module, lr: float, index: int) -> None:
    """An Adam-like step: every element moves by lr, its sign from its own bits (replicas agree)."""
    for param in chunk.parameters():
        param.add_(lr * torch.sign(torch.sin(param * 1e4 + index)))


def rollout_dtype(name: str, dtype: str) -> torch.dtype:
    """The rollout's dtype of a tensor: Megatron keeps a router's expert_bias in fp32."""
    return torch.float32 if name.endswith("expert_bias") else DTYPES[dtype]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def gathered(record: dict) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def sizes(model: ModelSpec, bucket: int) -> dict:
    """What the peak is held against: the bucket, one layer's experts, the largest tensor (fp32)."""
    return {"bucket": bucket, "largest": max(s.numel * 4 for s in model.tensors),
            "layer_experts": sum(s.numel * 4 for s in model.tensors if s.expert is not None and s.layer == 0)}


def colocated(name: str, dtype: str, lr: float, bucket: int = BUCKET, steps: int = STEPS) -> dict:
    model = spec_of(name)
    moe = model.num_experts > 0
    layout = Layout(tp=2, dp=2, ep=2, etp=1) if moe else Layout(tp=2, dp=2)
    rg = regroup(layout, 1, 1, 2 if moe else 1, model.num_experts)
    full = full_model(model)

    locals_ = plan_reshard(model, rg, "micro_dp", 1).sources[dist.get_rank()]
    chunk = chunk_of(model, full, locals_)
    wire = DTYPES[dtype]
    dense = Resharder.create(model, rg, [chunk], bucket, out_dtype=wire)
    delta = Resharder.create(model, rg, [chunk], bucket, out_dtype=wire, delta=True)
    record = {"equal": [], "received": [], "dense_received": [], "peak": [], "peak_full": [], "changed": []}
    record |= sizes(model, bucket)
    for index in range(steps + 1):
        if index:
            step(chunk, lr, index)
        a, b = dense.sync(), delta.sync()
        record["equal"].append(all(same_bits(a[k], b[k]) for k in a))
        record["received"].append(delta.last.bytes_received)
        record["dense_received"].append(dense.last.bytes_received)
        record["peak"].append(delta.last.peak_extra_bytes)
        record["peak_full"].append(dense.last.peak_extra_bytes)
        record["changed"].append(delta.last.elements_changed)
    record["delta_copy"] = delta.last.delta_copy_bytes
    return {"case": f"colocated:{name}:{dtype}:{lr}:{bucket >> 10}", "ranks": gathered(record)}


def free_port() -> int:
    """A free port chosen by rank 0, the same on every rank (the spanning group's store)."""
    port = [0]
    if dist.get_rank() == 0:
        with socket.socket() as sock:
            sock.bind((os.environ["MASTER_ADDR"], 0))
            port[0] = sock.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def split(name: str, dtype: str, lr: float, bucket: int = BUCKET, steps: int = STEPS) -> dict:
    """Ranks 0-1 train (tp=2), ranks 2-3 receive (t_g=1, d_g=2)."""
    model = spec_of(name)
    train, gen = Layout(tp=2, dp=1), Layout(tp=1, dp=2)
    rank = dist.get_rank()
    group = connect(os.environ["MASTER_ADDR"], free_port(), rank, 4)
    plans = [plan_transfer(model, train, gen, bucket // 4 // 2, delta=d) for d in (False, True)]
    record = {"equal": [], "received": [], "dense_received": [], "peak": [], "peak_sender": [], "changed": [],
              "peak_full": []}
    record |= sizes(model, bucket)
    if rank < 2:
        full = full_model(model)
        chunk = chunk_of(model, full, plans[0].sources[rank])
        sides = [ShardSender(plan, rank, [chunk]) for plan in plans]
    else:
        v = rank - 2
        sides = [ShardReceiver(plan, v, {t.name: torch.empty(t.shape, dtype=rollout_dtype(t.name, dtype),
                                                             device=compute_device())
                                         for t in plan.shards[v]}) for plan in plans]
    for side in sides:
        side.connect(group)
    for index in range(steps + 1):
        if index and rank < 2:
            step(chunk, lr, index)
        for side in sides:
            side.sync()
        dense, delta = sides
        if rank >= 2:
            record["equal"].append(all(same_bits(dense.outputs[k], delta.outputs[k]) for k in dense.outputs))
            record["received"].append(delta.last.bytes_received)
            record["dense_received"].append(dense.last.bytes_received)
            record["peak"].append(delta.last.peak_extra_bytes)
            record["changed"].append(delta.last.elements_changed)
        else:
            record["peak_sender"].append(delta.last.peak_extra_bytes)
            record["peak_full"].append(dense.last.peak_extra_bytes)
    record["delta_copy"] = sides[1].last.delta_copy_bytes
    dist.barrier()
    return {"case": f"split:{name}:{dtype}:{lr}:{bucket >> 10}", "ranks": gathered(record)}


if __name__ == "__main__":
    init_distributed()
    os.environ["DELTA_WORK"] = sys.argv[1]
    for arg in sys.argv[2:]:
        kind, name, dtype, lr, kib = arg.split(":")  # e.g. split:moe:bf16:1e-6:256 (bucket in KiB)
        result = {"colocated": colocated, "split": split}[kind](name, dtype, float(lr), int(kib) << 10)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
