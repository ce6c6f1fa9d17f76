"""Save and load model weights as Megatron dist checkpoints (``torch_dist``), layout-independent.

A checkpoint written in one layout loads into any other: Megatron's ``sharded_state_dict``
names every shard by its global tensor and offset. Saves are atomic: the files go to a
temporary directory that is renamed into place once every rank has finished.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


# Every layer under its own key (``decoder.layers.3.…``) rather than stacked on a layer axis,
# as Megatron already does for MoE models with dense layers: one format for dense and MoE.
SHARDED_METADATA = {"non_homogeneous_layers": True}


LAYER_KEYS = ("per_layer", "default")


def sharded_state_dict(chunks: List[torch.nn.Module], layer_keys: str = "per_layer") -> Dict:
    """The sharded state dict of this rank's model chunks: one chunk's dict, or ``model0``,
    ``model1``, ... for virtual pipeline stages (their local names repeat; the tensors'
    checkpoint keys are global either way). ``layer_keys``: ``per_layer`` names every layer
    (``decoder.layers.3.…``); ``default`` is megatron-core's own default (homogeneous layers
    stacked under one key with a leading layer axis)."""
    assert layer_keys in LAYER_KEYS, layer_keys
    metadata = SHARDED_METADATA if layer_keys == "per_layer" else {}
    dicts = [_unwrap(chunk).sharded_state_dict(metadata=dict(metadata)) for chunk in chunks]
    return dicts[0] if len(dicts) == 1 else {f"model{i}": d for i, d in enumerate(dicts)}


def save_model(chunks: List[torch.nn.Module], path: str | Path) -> None:
    """Write this layout's weights to ``path`` (collective over the whole world)."""
    save_sharded(sharded_state_dict(chunks), path)


def save_sharded(state: Dict, path: str | Path, before_rename: Optional[Callable[[Path], None]] = None) -> None:
    """Save a sharded state dict atomically: into ``path.tmp``, then renamed to ``path``.
    ``before_rename(tmp)`` runs on rank 0 to add files (e.g. the HF config) first."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = torch.distributed.get_rank()
    if path.exists():  # every rank sees the same (shared) file system: all raise together
        raise FileExistsError(f"checkpoint {path} already exists; remove it or choose another path")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(tmp))
    torch.distributed.barrier()
    if rank == 0:
        if before_rename is not None:
            before_rename(tmp)
        tmp.rename(path)
    torch.distributed.barrier()


def load_model(chunks: List[torch.nn.Module], path: str | Path) -> None:
    """Load weights saved by :func:`save_model` in any layout into this layout's chunks."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a Megatron dist checkpoint (no metadata.json)")
    state = dist_checkpointing.load(sharded_state_dict(chunks), str(path))
    per_chunk = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    for chunk, loaded in zip(chunks, per_chunk):
        module = _unwrap(chunk)
        own = {k: v for k, v in loaded.items() if k in module.state_dict()}
        module.load_state_dict(own, strict=False)
