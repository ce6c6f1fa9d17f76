"""HF safetensors ↔ Megatron dist checkpoint (torch_dist), streaming, in any layout.

``hf_to_mcore``: every rank builds its own shard of the Megatron model in the requested layout
(no random init), asks Megatron which slice of which global tensor each of its parameters is,
reads only the HF tensors (or row ranges) those slices come from, and Megatron's
``dist_checkpointing`` writes the layout-independent checkpoint.
``mcore_to_hf``: needs no model: ranks split the checkpoint's tensors by layer, read each global
tensor straight from the checkpoint, map it back through the same table and write their own
safetensors shards; rank 0 names the shards and writes the index. Both write to a temporary
directory renamed into place at the end, so a failed run leaves no output behind; one that runs
out of space raises :class:`~megarl.checkpoint.disk.DiskFull` with the bytes it needed and had.
With ``record`` the output also holds ``conversion.json`` (:mod:`megarl.checkpoint.jobs`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file

from megarl.checkpoint.disk import named_if_full
from megarl.checkpoint.dist_ckpt import (
    read_tensor, save_sharded, sharded_state_dict, tensor_keys, verify_dist_checkpoint,
)
from megarl.checkpoint.hf_files import write_side_files
from megarl.checkpoint.hf_io import HFCheckpoint, ShardWriter, finalize
from megarl.checkpoint.integrity import manifest_root, safe_reader, verify_manifest
from megarl.checkpoint.jobs import conversion_record, write_record
from megarl.checkpoint.load import HF_SUBDIR, VALUE_HEAD_BIAS, fill_from_hf, hf_plan
from megarl.config import ModelConfig, ParallelConfig
from megarl.models import build_model
from megarl.models.builder import check_layout
from megarl.models.hf_config import megatron_args_from_hf
from megarl.models.hf_mapping import ConversionError, Item, build_plan, check_names, skipped_hf_names
from megarl.parallel import build_groups
from megarl.parallel.layout import Layout
from megarl.runtime import init_distributed, world_size_from_env

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class ConvertOptions:
    """Knobs shared by both directions."""

    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "auto"  # Megatron params: 'auto' keeps the HF weights' dtype
    transformer_impl: str = "auto"


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
                options: ConvertOptions = ConvertOptions(), record: bool = False) -> None:
    """Convert an HF checkpoint to a Megatron dist checkpoint; run on every rank of the world.
    ``record``: leave ``conversion.json`` in the output (:func:`~megarl.checkpoint.jobs.conversion_record`)."""
    prepared = prepare_hf_to_mcore(hf_dir, out_dir, parallel, options, world_size_from_env())
    hf, args, plan, layout = prepared.hf, prepared.args, prepared.plan, prepared.layout
    init_distributed()
    made = conversion_record("hf-to-mcore", hf.path, hf.files(), dataclasses.asdict(layout),
                             dataclasses.asdict(options)) if record else None
    if prepared.skipped and torch.distributed.get_rank() == 0:
        print(f"megarl convert: warning: skipping {len(prepared.skipped)} HF tensors that are not converted "
              f"(multi-token-prediction layers or a tied lm_head), e.g. '{prepared.skipped[0]}'", file=sys.stderr)

    groups = build_groups(layout)
    chunks = build_model(prepared.model_cfg, groups, args, initialize=False)
    state = sharded_state_dict(chunks, layer_keys="per_layer")  # the keys of the converter's table
    fill_from_hf(state, plan, hf, args.model_type)

    def add_hf_files(tmp: Path) -> None:
        hf.copy_side_files(tmp / HF_SUBDIR)
        carried = [n for n in hf.names() if args.carried and n.startswith(args.carried)]
        if carried and torch.distributed.get_rank() == 0:  # kept for the export (hf_config.Wrapper)
            save_file({n: hf.read(n).contiguous() for n in carried}, str(tmp / HF_SUBDIR / CARRIED))
        if made is not None:
            write_record(tmp, made)

    # Written in megatron-core's default layout, the one Megatron-LM loads (see dist_ckpt).
    save_sharded(sharded_state_dict(chunks, layer_keys="default"), Path(out_dir), before_rename=add_hf_files)
    groups.destroy()


@dataclass
class McoreToHFPlan:
    """Everything checked about a Megatron -> HF conversion before any process group exists."""

    ckpt_dir: Path
    config_dir: Path
    config: Dict
    by_key: Dict[str, List[Item]]  # Megatron key (local spec) -> its items
    # Megatron key -> (the key it is stored under, its index on a stacked layer axis or None)
    sources: Dict[str, Tuple[str, Optional[int]]]
    stored: Dict[str, object]  # stored key -> torch TensorStorageMetadata
    value_head: bool = False  # a scalar head (megarl train-rm's): exported as *ForSequenceClassification


def _locate(by_key: Dict[str, List[Item]], stored: Dict, num_layers: int, ckpt_dir: Path):
    """Where each Megatron tensor of the plan is stored: under its own key, per layer
    (``decoder.layers.3.x``) or stacked (``decoder.layers.x`` [layers, ...]), under the local
    or the Transformer Engine spec's name. Returns (sources, missing keys, unused stored keys)."""
    sources, missing = {}, []
    for key, items in by_key.items():
        rule, layer = items[0].rule, items[0].layer
        names = [name if items[0].part is None else f"{name}.{items[0].part}" for name in rule.names()]
        if layer is None:
            candidates = [(key, None)]
        else:
            candidates = ([(f"decoder.layers.{layer}.{name}", None) for name in names]
                          + [(f"decoder.layers.{name}", layer) for name in names])
        found = next((c for c in candidates if c[0] in stored), None)
        if found is None:
            missing.append(key)
            continue
        if found[1] is not None and stored[found[0]].size[0] != num_layers:
            raise ConversionError(f"{ckpt_dir}: stacked '{found[0]}' has {stored[found[0]].size[0]} layers, "
                                  f"the config has {num_layers}")
        sources[key] = found
    unused = sorted(set(stored) - {k for k, _ in sources.values()})
    return sources, missing, unused


def prepare_mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path,
                        hf_config_dir: Optional[str | Path] = None, hashes: bool = True) -> McoreToHFPlan:
    """Check the checkpoint's files (with ``hashes``, their SHA-256 where a run checkpoint's
    manifest covers them), its config and its tensor names, and the output path (no process
    group)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    root = manifest_root(ckpt_dir) if hashes else None
    if root is not None:  # a run checkpoint's role (step_N/actor): its files' hashes
        verify_manifest(root, under=None if root == ckpt_dir else ckpt_dir.name)
    metadata = verify_dist_checkpoint(ckpt_dir)
    config_dir = Path(hf_config_dir) if hf_config_dir else ckpt_dir / HF_SUBDIR
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no HF config.json in {config_dir}; pass the source model's directory "
                                f"as --hf-config")
    config = json.loads((config_dir / "config.json").read_text())
    args = megatron_args_from_hf(config)
    # A training checkpoint also holds the optimizer's state ("optimizer.*"): not weights.
    stored = {k: metadata.state_dict_metadata[k] for k in tensor_keys(metadata)}
    embedding = stored.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ConversionError(f"{ckpt_dir} has no 'embedding.word_embeddings.weight'")
    head = stored.get("output_layer.weight")
    value_head = head is not None and head.size[0] == 1  # a reward model's scalar head
    by_key = hf_plan(args, embedding.size[0], value_head=value_head).by_mcore_key(te_names=False)
    sources, missing, unexpected = _locate(by_key, stored, args.config_kwargs["num_layers"], ckpt_dir)
    unexpected = [k for k in unexpected if not (value_head and k == VALUE_HEAD_BIAS)]  # checked zero on export
    if missing or unexpected:
        raise ConversionError(
            f"{ckpt_dir} does not match its {args.model_type} config: "
            + (f"{len(missing)} missing Megatron tensor(s), first '{missing[0]}'" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"{len(unexpected)} unexpected, first '{unexpected[0]}'" if unexpected else ""))
    if out_dir.exists():
        raise FileExistsError(f"output {out_dir} already exists; remove it or choose another path")
    return McoreToHFPlan(ckpt_dir, config_dir, config, by_key, sources, stored, value_head)


def mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "auto",
                max_shard_bytes: int = 2 * 10**9, hf_config_dir: Optional[str | Path] = None,
                tokenizer_dir: Optional[str | Path] = None, hashes: bool = True, record: bool = False) -> None:
    """Convert a Megatron dist checkpoint (any layout it was saved in, per-layer or stacked
    keys, local or Transformer Engine names) to HF safetensors. A failure removes the
    temporary output. Beside the weights go config.json (with ``architectures`` and their
    dtype), generation_config.json and the tokenizer of ``tokenizer_dir`` (default: the
    config's directory), never the source's weights (:mod:`megarl.checkpoint.hf_files`).
    ``hashes=False``: the caller has checked the files' hashes already. ``record``: leave
    ``conversion.json`` in the output (:func:`~megarl.checkpoint.jobs.conversion_record`)."""
    # Rank 0 alone reads every file for its hash (the others would read them all again); when
    # it fails, the launcher (torchrun, srun) stops the ranks waiting for it.
    hashes = hashes and os.environ.get("RANK", "0") == "0"
    prepared = prepare_mcore_to_hf(ckpt_dir, out_dir, hf_config_dir, hashes)
    out_dir = Path(out_dir)
    init_distributed()
    read = [f for f in prepared.ckpt_dir.rglob("*") if f.is_file()] + [prepared.config_dir / "config.json"]
    made = conversion_record("mcore-to-hf", prepared.ckpt_dir, sorted(set(read)), None,
                             {"dtype": dtype, "max_shard_bytes": max_shard_bytes,
                              "hf_config": str(prepared.config_dir.absolute())}) if record else None
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    try:
        _write_hf(prepared, out_dir, tmp, dtype, max_shard_bytes, tokenizer_dir, made)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


CARRIED = "carried.safetensors"  # beside a converted checkpoint's config: the tensors a wrapper carries


def carried_tensors(config: Dict, config_dir: Path) -> Tuple[Optional[HFCheckpoint], List[str]]:
    """The HF tensors a wrapped model (hf_config.Wrapper: Qwen3.5's vision tower) carries
    unchanged into an export, and where they are read: the source HF directory beside the config
    (a ``model.path`` run), or the ``carried.safetensors`` a conversion kept."""
    prefixes = megatron_args_from_hf(config).carried
    if not prefixes or not any(config_dir.glob("*.safetensors")):
        return None, []
    source = HFCheckpoint(config_dir)
    return source, [n for n in source.names() if n.startswith(prefixes)]


def _write_hf(prepared: McoreToHFPlan, out_dir: Path, tmp: Path, dtype: str, max_shard_bytes: int,
              tokenizer_dir: Optional[str | Path], record: Optional[Dict]) -> None:
    config, config_dir, by_key = prepared.config, prepared.config_dir, prepared.by_key
    reader = safe_reader(prepared.ckpt_dir)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    out_dtype = _output_dtype(dtype, config)
    needed = _output_bytes(prepared, out_dtype)
    # around the writes alone: a source file that fails to read stays named as such
    writing = partial(named_if_full, out_dir, needed, "the weights in the output dtype", tmp)
    writer = ShardWriter(tmp, f"rank{rank:05d}", max_shard_bytes)
    parts: List[torch.Tensor] = []  # the parts read so far of a tensor stored in parts
    for key, items in by_key.items():
        layer = items[0].layer
        # layers round-robin; the output layer (as large as the embedding) on the last rank
        owner = layer % world if layer is not None else (world - 1 if key.startswith("output_layer") else 0)
        if owner != rank:
            continue
        stored_key, stacked_layer = prepared.sources[key]
        tensor = read_tensor(reader, stored_key, prepared.stored[stored_key], stacked_layer)
        rule = items[0].rule
        if items[0].part is not None:  # the plan lists a rule's parts in order: join them at the last
            parts.append(tensor)
            if len(parts) < len(rule.parts):
                continue
            tensor, parts = torch.cat(parts, dim=0), []
        with writing():
            for item in items:
                part = tensor if item.expert is None else tensor[item.expert]
                for name, value in zip(item.hf_names, item.rule.transform.to_hf(part)):
                    writer.add(name, value.to(out_dtype or value.dtype).clone())
        del tensor
    if rank == 0 and prepared.value_head:  # HF's score has no bias: the Bradley-Terry loss never moves it
        bias = read_tensor(reader, VALUE_HEAD_BIAS, prepared.stored[VALUE_HEAD_BIAS], None)
        if bias.abs().max() > 0:
            raise ConversionError(f"{prepared.ckpt_dir}: the value head's bias is {bias.tolist()}; an HF "
                                  f"*ForSequenceClassification score has none, so it cannot be exported")
    if rank == 0:  # a wrapper's untrained tensors, as they were (Qwen3.5's vision tower)
        source, carried = carried_tensors(config, config_dir)
        with writing():
            for name in carried:
                writer.add(name, source.read(name))
    with writing():
        writer.flush()
    gathered: List[Optional[Dict]] = [None] * world
    torch.distributed.all_gather_object(gathered, {"map": writer.weight_map, "bytes": writer.total_bytes})
    if rank == 0:
        weight_map = {k: v for part in gathered for k, v in part["map"].items()}
        with writing():
            finalize(tmp, weight_map, sum(part["bytes"] for part in gathered))
            written = out_dtype or prepared.stored["embedding.word_embeddings.weight"].properties.dtype
            write_side_files(tmp, config, written, config_dir, Path(tokenizer_dir) if tokenizer_dir else None,
                             sequence_classification=prepared.value_head)
            if record is not None:
                write_record(tmp, record)
        tmp.rename(out_dir)
    torch.distributed.barrier()


def _output_bytes(prepared: McoreToHFPlan, out_dtype: Optional[torch.dtype]) -> int:
    """Bytes of the weights an export writes: every stored tensor it reads, in ``out_dtype``
    (else its own); the vocabulary's padding rows, which are dropped, are counted too."""
    keys = {stored_key for stored_key, _ in prepared.sources.values()}
    return sum(math.prod(prepared.stored[k].size) * (out_dtype or prepared.stored[k].properties.dtype).itemsize
               for k in keys)


def _output_dtype(choice: str, config: Dict) -> Optional[torch.dtype]:
    """'auto' = the dtype the HF config names (the source's), else as stored."""
    if choice == "auto":
        named = config.get("dtype") or config.get("torch_dtype")
        return getattr(torch, named) if isinstance(named, str) and hasattr(torch, named) else None
    if choice not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {choice} must be auto, float32, bfloat16 or float16")
    return getattr(torch, choice)
