"""A model's full training state as a Megatron dist checkpoint: weights, (distributed) optimizer
state, LR/WD scheduler and every rank's RNG states, plus ``layout.json`` (the layout and format
it was written in).

Two optimizer formats (``OPTIMIZER_FORMATS``):
* ``reshardable`` (default): Megatron's model-space format. Every optimizer tensor (fp32 main
  weight, exp_avg, exp_avg_sq) is stored per parameter under the parameter's global name and
  offsets, so a run resumes at any tp/pp/dp/ep/etp/vpp. Saving gathers each parameter's state
  over the data-parallel group.
* ``dp_reshardable``: Megatron's bucket-space format. No gather at save, but the buckets depend
  on tp/pp/ep: only dp may change on resume.

Same layout → an exact resume (each rank gets its own RNG streams back). Another layout →
weights, optimizer, scheduler and step are exact; RNG streams are those of the new layout's
seeding (they are per rank and do not map across layouts).

Collective over the world; the caller picks the directory (the run-level checkpoint manager
writes into a temporary one and renames it when every part is in). With ``async_queue`` the
tensors are written by a background process (Megatron's async save); the caller must finalize
the queue before it treats the directory as complete.
"""

from __future__ import annotations

import dataclasses
import json
import random
from functools import partial
from pathlib import Path
from typing import Any, List, Optional, Protocol

import numpy as np
import torch

from megarl.checkpoint.disk import call_named_if_full, named_if_full
from megarl.checkpoint.dist_ckpt import (
    TENSOR_BYTES, _unwrap, checkpoint_layer_keys, load_own, sharded_state_dict, tensor_bytes, verify_dist_checkpoint,
)
from megarl.checkpoint.integrity import record_hashes, weights_only_loads, write_then_record_hashes
from megarl.models import lora
from megarl.runtime.devices import group_device


class TrainState(Protocol):
    """What is saved and restored: a :class:`megarl.engines.train_state.TrainState` (named by its
    fields here, since the engines build on this package)."""

    model: List[torch.nn.Module]  # DDP-wrapped chunks
    optimizer: Any  # megatron MegatronOptimizer
    scheduler: Any  # megatron OptimizerParamScheduler
    groups: Any  # megarl.parallel.layout.ParallelGroups


OPTIMIZER_FORMATS = {"reshardable": "fully_reshardable", "dp_reshardable": "dp_reshardable"}
LAYOUT_FILE = "layout.json"
# Layout fields that change the dp_reshardable buckets (dp alone does not).
_BUCKET_FIELDS = ("tp", "pp", "ep", "etp", "cp", "vpp")


def _metadata(fmt: str) -> dict:
    if fmt not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer checkpoint format '{fmt}' is not one of {sorted(OPTIMIZER_FORMATS)}")
    # Keys without a per-optimizer prefix in model space: a dense and an expert optimizer
    # (MoE) describe disjoint parameters, and the keys stay valid when ep changes.
    return {"distrib_optim_sharding_type": OPTIMIZER_FORMATS[fmt], "chained_optim_avoid_prefix": True}


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


def _optimizers(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])


def save_train_state(state: TrainState, path: Path, optimizer_format: str = "reshardable",
                     async_queue=None, hash_files: bool = True) -> None:
    """Write ``state`` under ``path`` (created on rank 0; every rank must see it).

    ``async_queue``: a Megatron ``AsyncCallsQueue``; the tensor files are then written in the
    background and are complete once the queue's calls are finalized.
    A write that runs out of space raises :class:`~megarl.checkpoint.disk.DiskFull` (for an async
    save, at its finalize) with the bytes of the tensors the save writes.
    ``hash_files``: each rank records the SHA-256 of the files it wrote for the checkpoint's
    manifest (:func:`megarl.checkpoint.integrity.record_hashes`), with an async save in the
    background writer; ``False`` exists for the benchmark's side-by-side timing."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint import results_queue

    metadata = _metadata(optimizer_format)
    rank = torch.distributed.get_rank()
    # The model's keys are megatron-core's default (stacked layers), which Megatron-LM reads.
    model = trainable_only(state.model, sharded_state_dict(state.model, layer_keys="default"))
    sharded = {"model": model}
    if state.optimizer is not None:
        if _adam_step(state.optimizer) is None:
            # Not stepped yet (the actor in the critic's warm-up, trainer.critic_warmup_steps): saved
            # as a fresh Adam, zero moments at step 0, what its first step starts from anyway
            # (Megatron's state_dict asserts one step count over the parameters' states).
            _materialize_adam_state(state.optimizer)
        sharded["optimizer"] = state.optimizer.sharded_state_dict(model, metadata=metadata)
    needed = tensor_bytes(sharded)
    with named_if_full(path, needed, TENSOR_BYTES, partial=path):
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            layout = dataclasses.asdict(state.groups.layout)
            (path / LAYOUT_FILE).write_text(json.dumps({"layout": layout, "optimizer_format": optimizer_format,
                                                        "world_size": torch.distributed.get_world_size()}))
        torch.distributed.barrier()
        local = {"rng": _rng_state(), "scheduler": state.scheduler.state_dict() if state.scheduler else None,
                 "adam_step": _adam_step(state.optimizer) if state.optimizer is not None else None}
        torch.save(local, path / f"rank_{rank}.pt")
        results_queue.install()  # megatron-core's writer reports through a queue started by fork, not spawn
        request = dist_checkpointing.save(sharded, str(path), async_sharded_save=async_queue is not None)
    files = partial(own_files, path, rank)
    if async_queue is not None:
        # the background writer's errors surface in the finalize (the queue's
        # maybe_finalize_async_calls), on every rank: named there
        request = request._replace(finalize_fns=[partial(call_named_if_full, fn, path, needed, TENSOR_BYTES, path)
                                                 for fn in request.finalize_fns])
        if hash_files and request.async_fn is not None:  # hashed by the background writer, once written
            request = request._replace(async_fn=partial(write_then_record_hashes, request.async_fn, path, rank, files))
        elif hash_files:
            record_hashes(path, files(), rank)
        async_queue.schedule_async_request(request)
    elif hash_files:
        record_hashes(path, files(), rank)
    torch.distributed.barrier()


def trainable_only(chunks: List[torch.nn.Module], model: dict) -> dict:
    """A LoRA model's sharded state dict keeps its trainable tensors only (the adapters, a
    critic's value head): the frozen base is ``model.path``'s, which the run's config.yaml names.
    Other models' dicts are returned as they are."""
    if not lora.has_lora([_unwrap(c) for c in chunks]):
        return model

    def keep(value) -> bool:
        data = getattr(value, "data", None)
        return isinstance(data, torch.nn.Parameter) and data.requires_grad

    return {k: (trainable_only(chunks, v) if isinstance(v, dict) else v) for k, v in model.items()
            if isinstance(v, dict) or keep(v)}


def own_files(path: Path, rank: int) -> List[Path]:
    """The files this rank has written under ``path``: its tensor files (torch's dist-checkpoint
    writer names them ``__<rank>_<i>.distcp``), its ``rank_<r>.pt``, and on rank 0 the shared
    files written so far (an async save's ``.metadata`` and ``metadata.json`` come at finalize:
    the driver hashes them, they are small)."""
    shared = [LAYOUT_FILE, "common.pt", ".metadata", "metadata.json"] if rank == 0 else []
    return (sorted(path.glob(f"__{rank}_*.distcp")) + [path / f"rank_{rank}.pt"]
            + [path / name for name in shared if (path / name).is_file()])


def _step_per_parameter(inner) -> bool:
    """Where an Adam keeps its step count: torch's Adam/AdamW in each parameter's state (a tensor),
    Transformer Engine's (and apex's) FusedAdam in each param group (``group["step"]``, an int;
    its per-parameter state holds only its moments, and its state_dict() raises KeyError on any
    other key)."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _materialize_adam_state(optimizer) -> None:
    """Give a fresh Adam its per-parameter state so that Megatron can describe it for loading: the
    moments, and torch Adam's step (without TE/apex Megatron reads the step from that state)."""
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                st = inner.state[param]
                st.setdefault("exp_avg", torch.zeros_like(param.data))
                st.setdefault("exp_avg_sq", torch.zeros_like(param.data))
                if _step_per_parameter(inner):
                    st.setdefault("step", torch.tensor(0.0))


def _adam_step(optimizer) -> Optional[float]:
    """The optimizer's step count (the same for every parameter and group), None before its first step."""
    steps = set()
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        if _step_per_parameter(inner):
            steps |= {float(st["step"]) for st in inner.state.values() if "step" in st}
        else:  # TE's FusedAdam steps only groups with parameters
            steps |= {float(g["step"]) for g in inner.param_groups if g["params"] and "step" in g}
    assert len(steps) <= 1, f"the optimizer's parameters are at different steps {sorted(steps)}"
    return steps.pop() if steps else None


def _restore_adam_step(optimizer, step: float) -> None:
    """Put the saved step where the optimizer keeps it, so that Adam's bias correction continues.
    torch Adam: each parameter gets its own tensor (Megatron 0.16 restores it from the loading
    template, as one tensor shared by all parameters, and Adam would then add 1 per parameter).
    TE's FusedAdam: every param group (Megatron aligns the step of empty groups too); megarl's
    model-space load takes no param groups from the checkpoint, so without this the step restarts."""
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        if _step_per_parameter(inner):
            for param_state in inner.state.values():
                param_state["step"] = torch.tensor(step, dtype=torch.float32)
        else:
            for group in inner.param_groups:
                group["step"] = int(step)


@torch.no_grad()
def _load_model_space_param_state(opt, param_state: dict) -> None:
    """Copy model-space optimizer tensors (whole TP-local parameters) into this DP rank's range
    of each parameter. Megatron 0.16's own loader for this format copies every key of the
    optimizer's per-parameter state, and torch Adam's 'step' is not among the saved tensors
    (KeyError); the iteration order is the one its save uses (``buffer.param_index_map``)."""
    from itertools import chain

    param_idx = -1
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        ranges = dict(chain.from_iterable(m["param_map"].items() for per_bucket in gbuf_range_maps.values()
                                          for m in per_bucket))
        for model_param in opt.buffers[gbuf_idx].param_index_map:
            param_idx += 1
            if model_param not in ranges:
                continue
            local = ranges[model_param]["param"]
            dst = opt._get_main_param_and_optimizer_states(model_param)
            for key, value in param_state[param_idx].items():
                if key == "step":
                    continue
                dst["param" if key == "fp32_param" else key].copy_(value.flatten()[local.start:local.end])


def _saved_layout(path: Path) -> dict:
    file = path / LAYOUT_FILE
    if not file.is_file():  # written before layout.json existed: dp_reshardable, same layout
        return {"layout": None, "optimizer_format": "dp_reshardable"}
    return json.loads(file.read_text())


def load_train_state(state: TrainState, path: Path) -> bool:
    """Restore ``state`` from :func:`save_train_state` output. Returns True when the layout is
    the saved one (an exact resume, RNG included), False after a re-layout."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    saved = _saved_layout(path)
    fmt = saved["optimizer_format"]
    layout = dataclasses.asdict(state.groups.layout)
    same_layout = saved["layout"] == layout
    if state.optimizer is not None and fmt == "dp_reshardable" and saved["layout"] is not None:
        changed = [f"{k}={saved['layout'][k]}→{layout[k]}" for k in _BUCKET_FIELDS if saved["layout"][k] != layout[k]]
        if changed:
            raise ValueError(f"{path}: the optimizer state was saved in the dp_reshardable format, which only "
                             f"allows dp to change, but {', '.join(changed)}; resume with the saved layout "
                             f"(then save with trainer.checkpoint_format=reshardable to change it)")
    # Per-layer keys in checkpoints written before megarl used megatron-core's default layout.
    model = sharded_state_dict(state.model, layer_keys=checkpoint_layer_keys(verify_dist_checkpoint(path)))
    model = trainable_only(state.model, model)
    sharded = {"model": model}
    model_space = fmt == "reshardable"
    if state.optimizer is not None:
        _materialize_adam_state(state.optimizer)
        sharded["optimizer"] = state.optimizer.sharded_state_dict(model, is_loading=True, metadata=_metadata(fmt))
    with weights_only_loads():
        loaded = dist_checkpointing.load(sharded, str(path))
    chunks = state.model
    per_chunk = [loaded["model"]] if len(chunks) == 1 else [loaded["model"][f"model{i}"] for i in range(len(chunks))]
    for chunk, weights in zip(chunks, per_chunk):
        load_own(_unwrap(chunk), weights)
    if state.optimizer is not None:
        opts = _optimizers(state.optimizer)
        parts = [loaded["optimizer"]] if len(opts) == 1 else [loaded["optimizer"][i] for i in range(len(opts))]
        if model_space and all(isinstance(opt, DistributedOptimizer) for opt in opts):
            # Only the per-parameter tensors are taken: the number of chained optimizers can
            # change with the layout (MoE: an expert optimizer exists only where expert and
            # dense data-parallel groups differ), so the saved param-group lists need not
            # match; lr and wd come from the restored scheduler, betas and eps from the config.
            for opt, part in zip(opts, parts):
                _load_model_space_param_state(opt, part["param_state"])
        else:
            for opt in opts:
                opt.optimizer.state.clear()  # Megatron re-creates it from the checkpoint
            with torch.no_grad():  # fp32 main parameters are views of the (leaf) model parameters
                state.optimizer.load_state_dict(loaded["optimizer"])
    rank_file = path / f"rank_{torch.distributed.get_rank()}.pt"
    # Scheduler and Adam step are the same on every rank: rank 0's file serves a new layout.
    local = torch.load(rank_file if same_layout else path / "rank_0.pt", weights_only=True)
    if state.scheduler is not None and local["scheduler"] is not None:
        state.scheduler.load_state_dict(local["scheduler"])
        state.scheduler.step(increment=0)  # put the restored step's lr and wd on the param groups
    if same_layout:
        _set_rng_state(local["rng"])
    if state.optimizer is not None and local.get("adam_step") is not None:
        _restore_adam_step(state.optimizer, local["adam_step"])
    return same_layout


def weights_checksum(state: TrainState) -> float:
    """Sum of squares of the model's weights in float64, each distinct weight counted once:
    the same weights give the same number in any layout (up to summation order). Collective
    over the world.

    A local tensor's sum is divided by its number of copies among the ranks of its pipeline
    stage: dp*cp*tp over its distinct shards (tp for TP-split tensors, 1 for replicated ones;
    experts: ep, times etp if split). The last stage's copy of tied embeddings is skipped."""
    layout = state.groups.layout
    stage_ranks = layout.tp * layout.cp * layout.dp
    total = torch.zeros(1, dtype=torch.float64, device=group_device())  # all-reduced over the world
    for chunk in state.model:
        for param in _unwrap(chunk).parameters():
            if getattr(param, "shared", False):  # duplicate of the first stage's embedding
                continue
            split = getattr(param, "tensor_model_parallel", False)
            if getattr(param, "allreduce", True):  # dense
                shards = layout.tp if split else 1
            else:  # an expert: distinct per ep rank
                shards = layout.ep * (layout.etp if split else 1)
            total += param.detach().double().pow(2).sum() * shards / stage_ranks
    torch.distributed.all_reduce(total)
    return float(total.item())
