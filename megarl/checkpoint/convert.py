"""HF safetensors ↔ Megatron dist checkpoint (torch_dist), streaming, in any layout.

``hf_to_mcore``: every rank builds its own shard of the Megatron model in the requested layout
(no random init), asks Megatron which slice of which global tensor each of its parameters is,
reads only the HF tensors (or row ranges) those slices come from, and Megatron's
``dist_checkpointing`` writes the layout-independent checkpoint.
``mcore_to_hf``: needs no model: ranks split the checkpoint's tensors by layer, read each global
tensor straight from the checkpoint, map it back through the same table and write their own
safetensors shards; rank 0 names the shards and writes the index. Both write to a temporary
directory renamed into place at the end, so a failed run leaves no output behind.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from megarl.checkpoint.hf_io import HFCheckpoint, ShardWriter, finalize
from megarl.checkpoint.hf_mapping import (
    IDENTITY, ConversionError, Item, build_plan, check_names, skipped_hf_names,
)
from megarl.config import ModelConfig, ParallelConfig
from megarl.models.builder import check_layout
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel.layout import Layout

HF_SUBDIR = "hf"  # the source's config.json and tokenizer files, kept inside the Megatron checkpoint
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class ConvertOptions:
    """Knobs shared by both directions."""

    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "auto"  # Megatron params: 'auto' keeps the HF weights' dtype
    transformer_impl: str = "auto"


def _raise_if_any(errors: List[str]) -> None:
    """Collective: every rank raises if any rank found a problem (rank 0's message first)."""
    gathered: List[Optional[List[str]]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, errors)
    found = [f"rank {r}: {e}" for r, errs in enumerate(gathered) for e in (errs or [])]
    if found:
        more = f" (+{len(found) - 3} more)" if len(found) > 3 else ""
        raise ConversionError("; ".join(found[:3]) + more)


def _source_dtype(hf: HFCheckpoint) -> str:
    name = hf.dtype_name(hf.names()[0])
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(name, "float32")


@dataclass
class HFToMcorePlan:
    """Everything checked about an HF -> Megatron conversion before any process group exists."""

    hf: HFCheckpoint
    args: object  # MegatronModelArgs
    plan: object  # hf_mapping.Plan
    skipped: List[str]
    model_cfg: ModelConfig
    layout: Layout


def prepare_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig,
                        options: ConvertOptions, world_size: int) -> HFToMcorePlan:
    """Check names, model type, layout and output path (pure: no tensors, no groups)."""
    hf = HFCheckpoint(hf_dir)
    args = megatron_args_from_hf(hf.config)
    plan = build_plan(args, options.make_vocab_size_divisible_by)
    names = hf.names()
    skipped = skipped_hf_names(args, names)
    if args.tie_word_embeddings and "lm_head.weight" in names:
        skipped.append("lm_head.weight")  # a tied copy some checkpoints keep
    check_names(plan, names, skipped, str(hf.path))
    model_cfg = ModelConfig(
        hf_config=str(hf.path), make_vocab_size_divisible_by=options.make_vocab_size_divisible_by,
        params_dtype=_source_dtype(hf) if options.params_dtype == "auto" else options.params_dtype,
        transformer_impl=options.transformer_impl)
    layout = Layout.from_config(parallel, world_size)
    check_layout(args, layout, model_cfg)
    if Path(out_dir).exists():
        raise FileExistsError(f"output {out_dir} already exists; remove it or choose another path")
    return HFToMcorePlan(hf, args, plan, skipped, model_cfg, layout)


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig,
                options: ConvertOptions = ConvertOptions()) -> None:
    """Convert an HF checkpoint to a Megatron dist checkpoint; run on every rank of the world."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megarl.models import build_model
    from megarl.parallel import build_groups
    from megarl.runtime import init_distributed, world_size_from_env
    from megarl.training.dist_ckpt import save_sharded, sharded_state_dict

    prepared = prepare_hf_to_mcore(hf_dir, out_dir, parallel, options, world_size_from_env())
    hf, args, plan, layout = prepared.hf, prepared.args, prepared.plan, prepared.layout
    init_distributed()
    if prepared.skipped and torch.distributed.get_rank() == 0:
        print(f"megarl convert: warning: skipping {len(prepared.skipped)} HF tensors that are not converted "
              f"(multi-token-prediction layers or a tied lm_head), e.g. '{prepared.skipped[0]}'", file=sys.stderr)

    groups = build_groups(layout)
    chunks = build_model(prepared.model_cfg, groups, args, initialize=False)
    state = sharded_state_dict(chunks)
    apply_factories(state)
    by_key = plan.by_mcore_key()
    shards = [sh for sh in nested_values(state) if isinstance(sh, ShardedTensor)]
    errors = []
    for sh in shards:  # check every name and shape before reading any weight
        if sh.key not in by_key:
            errors.append(f"Megatron tensor '{sh.key}' has no rule in the {args.model_type} table")
            continue
        errors += _check_shapes(sh, by_key[sh.key], hf)
    _raise_if_any(errors)
    with torch.no_grad():
        for sh in shards:
            sh.data.copy_(_read_slice(sh, by_key[sh.key], hf))

    def add_hf_files(tmp: Path) -> None:
        hf.copy_side_files(tmp / HF_SUBDIR)

    save_sharded(state, Path(out_dir), before_rename=add_hf_files)
    groups.destroy()


def _item_for(sh, items: List[Item]) -> Item:
    if items[0].expert is None:
        return items[0]
    return items[sh.global_offset[0]]  # stacked experts: the leading axis is the expert index


def _region(sh) -> tuple:
    """The slice of the (per-expert, for stacked experts) global tensor this shard holds."""
    skip = sh.prepend_axis_num
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset[skip:], sh.local_shape))


def _expected_hf_shapes(sh, item: Item) -> List[tuple]:
    shape = tuple(sh.global_shape[sh.prepend_axis_num:])
    return [tuple(t.shape) for t in item.rule.transform.to_hf(torch.empty(shape, device="meta"))]


def _check_shapes(sh, items: List[Item], hf: HFCheckpoint) -> List[str]:
    item = _item_for(sh, items)
    problems = []
    for name, want in zip(item.hf_names, _expected_hf_shapes(sh, item)):
        got = hf.shape(name)
        if got != want:
            problems.append(f"HF tensor '{name}' has shape {list(got)}, the config implies {list(want)} "
                            f"(for Megatron '{sh.key}')")
    return problems


def _read_slice(sh, items: List[Item], hf: HFCheckpoint) -> torch.Tensor:
    item = _item_for(sh, items)
    region = _region(sh)
    if item.rule.transform is IDENTITY:
        return hf.read(item.hf_names[0], region)  # a plain copy: read only this shard's slice
    full = item.rule.transform.to_mcore([hf.read(name) for name in item.hf_names])
    return full[region]


def mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "auto",
                max_shard_bytes: int = 2 * 10**9, hf_config_dir: Optional[str | Path] = None) -> None:
    """Convert a Megatron dist checkpoint (any layout it was saved in) to HF safetensors."""
    import torch.distributed.checkpoint as dcp

    from megarl.runtime import init_distributed

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a Megatron dist checkpoint (no metadata.json)")
    config_dir = Path(hf_config_dir) if hf_config_dir else ckpt_dir / HF_SUBDIR
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no HF config.json in {config_dir}; pass the source model's directory "
                                f"as --hf-config")
    config = json.loads((config_dir / "config.json").read_text())
    args = megatron_args_from_hf(config)
    reader = dcp.FileSystemReader(str(ckpt_dir))
    # A training checkpoint also holds the optimizer's state ("optimizer.*"): not weights.
    stored = {k: v for k, v in reader.read_metadata().state_dict_metadata.items()
              if hasattr(v, "size") and not k.startswith("optimizer.")}
    embedding = stored.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ConversionError(f"{ckpt_dir} has no 'embedding.word_embeddings.weight'")
    plan = build_plan(args, vocab_multiple=embedding.size[0])
    by_key = plan.by_mcore_key()
    missing = sorted(set(by_key) - set(stored))
    unexpected = sorted(set(stored) - set(by_key))
    if missing or unexpected:
        raise ConversionError(
            f"{ckpt_dir} does not match its {args.model_type} config: "
            + (f"{len(missing)} missing Megatron tensor(s), first '{missing[0]}'" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"{len(unexpected)} unexpected, first '{unexpected[0]}'" if unexpected else ""))
    if out_dir.exists():
        raise FileExistsError(f"output {out_dir} already exists; remove it or choose another path")

    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    out_dtype = _output_dtype(dtype, config)
    writer = ShardWriter(tmp, f"rank{rank:05d}", max_shard_bytes)
    for key, items in by_key.items():
        layer = items[0].layer
        # layers round-robin; the output layer (as large as the embedding) on the last rank
        owner = layer % world if layer is not None else (world - 1 if key.startswith("output_layer") else 0)
        if owner != rank:
            continue
        meta = stored[key]
        target = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        dcp.load(target, storage_reader=reader, no_dist=True)
        tensor = target.pop(key)
        for item in items:
            part = tensor if item.expert is None else tensor[item.expert]
            for name, value in zip(item.hf_names, item.rule.transform.to_hf(part)):
                writer.add(name, value.to(out_dtype or value.dtype).clone())
        del tensor
    writer.flush()
    gathered: List[Optional[Dict]] = [None] * world
    torch.distributed.all_gather_object(gathered, {"map": writer.weight_map, "bytes": writer.total_bytes})
    if rank == 0:
        weight_map = {k: v for part in gathered for k, v in part["map"].items()}
        finalize(tmp, weight_map, sum(part["bytes"] for part in gathered))
        for path in config_dir.iterdir():
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        tmp.rename(out_dir)
    torch.distributed.barrier()


def _output_dtype(choice: str, config: Dict) -> Optional[torch.dtype]:
    """'auto' = the dtype the HF config names (the source's), else as stored."""
    if choice == "auto":
        named = config.get("dtype") or config.get("torch_dtype")
        return getattr(torch, named) if isinstance(named, str) and hasattr(torch, named) else None
    if choice not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {choice} must be auto, float32, bfloat16 or float16")
    return getattr(torch, choice)
