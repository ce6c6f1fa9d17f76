"""Save and load model weights as Megatron dist checkpoints (``torch_dist``), layout-independent.

A checkpoint written in one layout loads into any other: Megatron's ``sharded_state_dict``
names every shard by its global tensor and offset. Saves are atomic: the files go to a
temporary directory that is renamed into place once every rank has finished; one that runs out
of space raises :class:`~megarl.checkpoint.disk.DiskFull`.

Key layout: megarl writes megatron-core's default ``sharded_state_dict`` (what Megatron-LM
writes and reads): the layers of a homogeneous model stacked under one key with a leading layer
axis (``decoder.layers.self_attention.linear_qkv.weight`` [layers, ...]), one key per layer
(``decoder.layers.3.…``) where the layers differ (DeepSeek's dense first layers). Reading
detects the layout from the checkpoint's keys, so checkpoints written per layer (megarl before
the default layout) keep loading.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megarl.checkpoint.disk import named_if_full
from megarl.checkpoint.hf_io import CheckpointFileError
from megarl.checkpoint.integrity import load_dist_metadata, safe_reader, weights_only_loads
from megarl.runtime.devices import group_device


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


# Every layer under its own key (``decoder.layers.3.…``) rather than stacked on a layer axis.
SHARDED_METADATA = {"non_homogeneous_layers": True}


LAYER_KEYS = ("per_layer", "default")
_PER_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")  # groups: the layer, the rest


@contextlib.contextmanager
def _megatron_lm_moe_freq(chunks: List[torch.nn.Module]) -> Iterator[None]:
    """Present an all-MoE ``moe_layer_freq`` list as the int 1 while the dict is built.

    megarl's builder always passes a per-layer list, and megatron-core writes one key per layer
    for any list; Megatron-LM's default ``--moe-layer-freq 1`` is an int, whose (homogeneous)
    layers megatron-core stacks. The two mean the same network: the keys follow Megatron-LM's."""
    found = {}
    for chunk in chunks:
        for module in _unwrap(chunk).modules():
            freq = getattr(getattr(module, "config", None), "moe_layer_freq", None)
            if isinstance(freq, list) and set(freq) == {1}:
                found[id(module.config)] = module.config
    changed = list(found.values())
    saved = [c.moe_layer_freq for c in changed]
    for config in changed:
        config.moe_layer_freq = 1
    try:
        yield
    finally:
        for config, freq in zip(changed, saved):
            config.moe_layer_freq = freq


def sharded_state_dict(chunks: List[torch.nn.Module], layer_keys: str = "per_layer") -> Dict:
    """The sharded state dict of this rank's model chunks: one chunk's dict, or ``model0``,
    ``model1``, ... for virtual pipeline stages (their local names repeat; the tensors'
    checkpoint keys are global either way). ``layer_keys``: ``per_layer`` names every layer
    (``decoder.layers.3.…``); ``default`` is megatron-core's own default as Megatron-LM
    configures it (homogeneous layers, MoE ones included, stacked under one key with a leading
    layer axis)."""
    assert layer_keys in LAYER_KEYS, layer_keys
    if layer_keys == "per_layer":
        dicts = [_unwrap(chunk).sharded_state_dict(metadata=dict(SHARDED_METADATA)) for chunk in chunks]
    else:
        with _megatron_lm_moe_freq(chunks):
            dicts = [_unwrap(chunk).sharded_state_dict() for chunk in chunks]
    return dicts[0] if len(dicts) == 1 else {f"model{i}": d for i, d in enumerate(dicts)}


def sharded_tensors(state: Dict) -> List:
    """The ShardedTensors of a sharded state dict, factories applied (their tensors views of the
    parameters: a copy into one fills the model)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(state)
    return [sh for sh in nested_values(state) if isinstance(sh, ShardedTensor)]


def _without(state: Dict, keys) -> Dict:
    """``state`` (nested dicts of sharded tensors) less the tensors whose checkpoint key is in ``keys``."""
    if not keys:
        return state
    return {name: _without(value, keys) if isinstance(value, dict) else value for name, value in state.items()
            if getattr(value, "key", None) not in keys}


def verify_dist_checkpoint(path: str | Path):
    """Check a dist checkpoint's files without reading any tensor: the metadata is readable
    (through :func:`~megarl.checkpoint.integrity.load_dist_metadata`'s allow-list), and every file it points to exists and is as long as its last recorded tensor needs.
    Returns torch's checkpoint ``Metadata``; raises :class:`CheckpointFileError` naming the
    file (and the tensor) otherwise."""
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a Megatron dist checkpoint (no metadata.json)")
    # Through the allow-list: megatron-core's own reader, which every load below then uses,
    # unpickles the same file without one.
    metadata = load_dist_metadata(path)
    needed: Dict[str, tuple] = {}  # file -> (bytes needed, the tensor that needs them)
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1,))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for name, (end, fqn) in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointFileError(f"{file} is missing (it holds '{fqn}')")
        size = file.stat().st_size
        if size < end:
            raise CheckpointFileError(f"{file} is truncated: {size} bytes, but '{fqn}' ends at byte {end}")
    return metadata


def tensor_keys(metadata) -> List[str]:
    """The tensor keys of a checkpoint's torch metadata (not pickled objects, no optimizer state)."""
    return [k for k, v in metadata.state_dict_metadata.items()
            if hasattr(v, "size") and not k.startswith("optimizer.")]


def checkpoint_layer_keys(metadata) -> str:
    """``per_layer`` if the checkpoint names its layers one by one, else ``default`` (stacked)."""
    return "per_layer" if any(_PER_LAYER_KEY.match(k) for k in tensor_keys(metadata)) else "default"


def read_tensor(reader, key: str, meta, layer: Optional[int] = None,
                region: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None) -> torch.Tensor:
    """One tensor of a dist checkpoint, read by this process alone (no process group): whole,
    with ``layer`` only that index of its leading (stacked layers) axis, or with ``region``
    (offsets, sizes) only that block, without reading the rest. ``reader``:
    :func:`megarl.checkpoint.integrity.safe_reader`'s; ``meta``: the key's storage metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    sizes = tuple(meta.size)
    offsets = (0,) * len(sizes)
    if layer is not None:
        offsets, sizes = (layer,) + offsets[1:], (1,) + sizes[1:]
    if region is not None:
        offsets, sizes = tuple(region[0]), tuple(region[1])
    dest = torch.empty(sizes, dtype=meta.properties.dtype)

    class RegionPlanner(DefaultLoadPlanner):
        """Reads the chunk ``offsets``/``sizes`` of the saved tensor into ``dest``."""

        def create_local_plan(self) -> LoadPlan:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            return LoadPlan(create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk]))

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    try:
        dcp.load({key: dest}, storage_reader=reader, planner=RegionPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # corrupt bytes: torch's unpickling errors
        inner = next(iter(getattr(exc, "failures", {}).values()), exc)  # rank -> (error, traceback)
        inner = inner[0] if isinstance(inner, tuple) else inner
        files = sorted({info.relative_path for index, info in (getattr(reader, "storage_data", None) or {}).items()
                        if index.fqn == key})
        raise CheckpointFileError(f"reading '{key}' from {', '.join(str(Path(reader.path) / f) for f in files) or reader.path} "
                                  f"failed (corrupt file?): {type(inner).__name__}: {str(inner).splitlines()[0][:160]}") from exc
    return dest if layer is None else dest[0]


def tensor_bytes(state: Dict) -> int:
    """Bytes of the tensors a save of the sharded state dict ``state`` writes, summed over the
    world (collective): each shard's main replica, the one megatron writes. The files take a
    little more (torch's structure around each tensor)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    local = sum(v.data.numel() * v.data.element_size() for v in nested_values(state)
                if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and is_main_replica(v.replica_id))
    total = torch.tensor([local], dtype=torch.int64, device=group_device())
    torch.distributed.all_reduce(total)
    return int(total.item())


TENSOR_BYTES = "the tensors it writes"  # what tensor_bytes estimates, for DiskFull's message


def save_model(chunks: List[torch.nn.Module], path: str | Path) -> None:
    """Write this layout's weights to ``path`` (collective over the whole world)."""
    save_sharded(sharded_state_dict(chunks, layer_keys="default"), path)


def save_sharded(state: Dict, path: str | Path, before_rename: Optional[Callable[[Path], None]] = None) -> None:
    """Save a sharded state dict atomically: into ``path.tmp``, then renamed to ``path``.
    ``before_rename(tmp)`` runs on rank 0 to add files (e.g. the HF config) first. A failure on
    this rank removes ``path.tmp``; one for lack of space is a ``DiskFull`` naming ``path``."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint import results_queue

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = torch.distributed.get_rank()
    if path.exists():  # every rank sees the same (shared) file system: all raise together
        raise FileExistsError(f"checkpoint {path} already exists; remove it or choose another path")
    needed = tensor_bytes(state)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        torch.distributed.barrier()
        with named_if_full(path, needed, TENSOR_BYTES, partial=tmp):
            results_queue.install()  # megatron-core's writer reports through a queue started by fork
            dist_checkpointing.save(state, str(tmp))
            torch.distributed.barrier()
            if rank == 0 and before_rename is not None:
                before_rename(tmp)
        if rank == 0:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    torch.distributed.barrier()


def load_model(chunks: List[torch.nn.Module], path: str | Path, skip=()) -> None:
    """Load weights saved by :func:`save_model`, by Megatron-LM, or per layer by earlier megarl,
    in any layout, into this layout's chunks; the tensors whose checkpoint keys ``skip`` names
    keep their values."""
    from megatron.core import dist_checkpointing

    metadata = verify_dist_checkpoint(path)
    wanted = _without(sharded_state_dict(chunks, checkpoint_layer_keys(metadata)), set(skip))
    with weights_only_loads():
        state = dist_checkpointing.load(wanted, str(path))
    per_chunk = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    for chunk, loaded in zip(chunks, per_chunk):
        load_own(_unwrap(chunk), loaded)


def load_own(module: torch.nn.Module, loaded: Dict) -> None:
    """Load the entries of ``loaded`` that are ``module``'s own state (others are ignored)."""
    keys = module.state_dict().keys()  # once: each call walks every submodule
    module.load_state_dict({k: v for k, v in loaded.items() if k in keys}, strict=False)



def load_first_layers(chunks: List[torch.nn.Module], path: str | Path) -> None:
    """Fill chunks built with the first N of a checkpoint's layers (a slice that
    :mod:`megarl.checkpoint.verify` checks) from it: each rank reads only its shards' blocks, of
    per-layer keys or of stacked ones (the layer's row), so memory and reads scale with the slice.
    (Megatron's own loader wants every stored tensor read whole, exactly once.)"""
    metadata = verify_dist_checkpoint(path)
    stored = metadata.state_dict_metadata
    reader = safe_reader(Path(path))
    with torch.no_grad():
        for sh in sharded_tensors(sharded_state_dict(chunks, layer_keys="per_layer")):
            offsets = tuple(sh.global_offset)
            sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            key, match = sh.key, _PER_LAYER_KEY.match(sh.key)
            if key not in stored and match:  # stacked: the layer is the leading axis
                key, offsets, sizes = f"decoder.layers.{match[2]}", (int(match[1]),) + offsets, (1,) + sizes
            if key not in stored:
                raise CheckpointFileError(f"{path} has no tensor '{sh.key}' (nor a stacked '{key}') that the "
                                          f"model needs")
            sh.data.copy_(read_tensor(reader, key, stored[key], region=(offsets, sizes)).view(sh.data.shape))
