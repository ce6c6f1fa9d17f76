"""A model's full training state as a Megatron dist checkpoint: weights, (distributed) optimizer
state, LR/WD scheduler and every rank's RNG states. Layout-independent weights and optimizer
state (``fully_sharded_model_space``), so a run can resume with another layout.

Collective over the world; the caller picks the directory (the run-level checkpoint manager
writes into a temporary one and renames it when every part is in).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megarl.training.dist_ckpt import _unwrap, sharded_state_dict
from megarl.training.lm import TrainState


OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_train_state(state: TrainState, path: Path) -> None:
    """Write ``state`` under ``path`` (created on rank 0; every rank must see it)."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    model = sharded_state_dict(state.model)
    sharded = {"model": model}
    if state.optimizer is not None:
        sharded["optimizer"] = state.optimizer.sharded_state_dict(model, metadata=OPTIMIZER_FORMAT)
    dist_checkpointing.save(sharded, str(path))
    local = {"rng": _rng_state(), "scheduler": state.scheduler.state_dict() if state.scheduler else None,
             "adam_step": _adam_step(state.optimizer) if state.optimizer is not None else None}
    torch.save(local, path / f"rank_{rank}.pt")
    torch.distributed.barrier()


def _materialize_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its per-parameter state (moments and step) so that Megatron can
    describe it for loading; without TE/apex it reads the step from that state."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                st = inner.state[param]
                if not st:
                    st["exp_avg"] = torch.zeros_like(param.data)
                    st["exp_avg_sq"] = torch.zeros_like(param.data)
                    st["step"] = torch.tensor(0.0)


def _adam_step(optimizer) -> Optional[float]:
    steps = {float(st["step"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
             for st in opt.optimizer.state.values() if "step" in st}
    return steps.pop() if len(steps) == 1 else None


def load_train_state(state: TrainState, path: Path) -> None:
    """Restore ``state`` from :func:`save_train_state` output (any layout for weights and
    optimizer; RNG and scheduler per rank, so the same world size for an exact resume)."""
    from megatron.core import dist_checkpointing

    model = sharded_state_dict(state.model)
    sharded = {"model": model}
    if state.optimizer is not None:
        _materialize_adam_state(state.optimizer)
        sharded["optimizer"] = state.optimizer.sharded_state_dict(model, is_loading=True, metadata=OPTIMIZER_FORMAT)
    loaded = dist_checkpointing.load(sharded, str(path))
    chunks = state.model
    per_chunk = [loaded["model"]] if len(chunks) == 1 else [loaded["model"][f"model{i}"] for i in range(len(chunks))]
    for chunk, weights in zip(chunks, per_chunk):
        module = _unwrap(chunk)
        module.load_state_dict({k: v for k, v in weights.items() if k in module.state_dict()}, strict=False)
    if state.optimizer is not None:
        for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
            opt.optimizer.state.clear()  # Megatron re-creates it from the checkpoint
        with torch.no_grad():  # fp32 main parameters are views of the (leaf) model parameters
            state.optimizer.load_state_dict(loaded["optimizer"])
    rank_file = path / f"rank_{torch.distributed.get_rank()}.pt"
    if rank_file.is_file():
        local = torch.load(rank_file, weights_only=True)
        if state.scheduler is not None and local["scheduler"] is not None:
            state.scheduler.load_state_dict(local["scheduler"])
            state.scheduler.step(increment=0)  # put the restored step's lr and wd on the param groups
        _set_rng_state(local["rng"])
        if state.optimizer is not None and local.get("adam_step") is not None:
            # Megatron 0.16 restores torch Adam's step (kept in each parameter's state when
            # there is no TE/apex) from the loading template, and as one tensor shared by all
            # parameters (Adam would then add 1 per parameter): each gets its own, saved value.
            for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
                for param_state in opt.optimizer.state.values():
                    param_state["step"] = torch.tensor(local["adam_step"], dtype=torch.float32)


def weights_checksum(state: TrainState) -> float:
    """Sum of squares of this model replica's weights in float64 (shards summed over the
    model-parallel group): equal weights in one layout give equal checksums."""
    total = torch.zeros(1, dtype=torch.float64)
    for chunk in state.model:
        for param in _unwrap(chunk).parameters():
            total += param.detach().double().pow(2).sum()
    groups = state.groups
    torch.distributed.all_reduce(total, group=groups.pg.mp)  # model-parallel ranks hold different shards
    return float(total.item())
