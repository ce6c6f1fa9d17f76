"""Pretrained weights straight into model chunks in any layout (``model.path``, ``reward_model.path``).

The source is an HF directory (safetensors, read through the converter's tables: each rank reads
only the tensors, or rows of tensors, its shards need) or a Megatron dist checkpoint (Megatron's
own resharding load). :func:`check_pretrained` checks a source against the model config before
any worker starts: files, names, shapes and dtypes, each a named :class:`ConversionError`.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from megarl.checkpoint.dist_ckpt import (
    checkpoint_layer_keys, load_model, sharded_state_dict, sharded_tensors, verify_dist_checkpoint,
)
from megarl.checkpoint.hf_files import HF_SUBDIR
from megarl.checkpoint.hf_io import INDEX, HFCheckpoint
from megarl.checkpoint.integrity import manifest_root, verify_manifest
from megarl.config import ConfigError, load_config
from megarl.config.schema import REWARD_MODEL
from megarl.models import build_model
from megarl.models.hf_config import megatron_args_from_hf
from megarl.models.hf_mapping import (
    IDENTITY, ConversionError, GateUp, Item, Plan, Rule, VocabPad, build_plan, check_names, skipped_hf_names,
)
from megarl.models.value_head import attach_value_head
from megarl.parallel import Layout, build_groups
from megarl.runtime import cpu_mode
from megarl.runtime.distributed import share_gloo_device

DEFAULT_HF_CONFIG = "configs/models/tiny-llama.json"  # model.hf_config when neither it nor model.path is set
LOADABLE_HF_DTYPES = ("F32", "BF16", "F16")  # copied into model.params_dtype (e.g. bf16 -> fp32 exactly)
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# An HF sequence-classification head (Llama/Qwen2/Qwen3ForSequenceClassification): score.weight
# [num_labels, hidden], no bias; megarl's value head keeps its bias at 0.
SCORE = "score.weight"
VALUE_HEAD_BIAS = "output_layer.bias"


@dataclass(frozen=True)
class PretrainedSource:
    """What a ``model.path`` points at."""

    kind: str  # "hf" or "mcore"
    weights: Path  # the HF directory, or the dist checkpoint directory (with metadata.json)
    config: Optional[Path]  # a config.json or its directory; None for a bare dist checkpoint (config given elsewhere)
    tokenizer: Optional[Path]  # a directory with tokenizer files, None if the source has none


def _tokenizer_dir(directory: Path) -> Optional[Path]:
    return directory if any((directory / f).is_file() for f in TOKENIZER_FILES) else None


def newest_checkpoint(path: str) -> str:
    """A run directory's newest checkpoint (``checkpoints/latest``: ``megarl train`` and ``megarl
    sft`` write them); other paths as they are."""
    latest = Path(path) / "checkpoints" / "latest"
    if latest.is_file():
        return str(Path(path) / "checkpoints" / latest.read_text().strip())
    return path


def locate(path: str | Path, field: str = "model.path", need_config: bool = True) -> PretrainedSource:
    """Accepted: an HF directory (config.json + ``*.safetensors``, with an index or not); a Megatron
    dist checkpoint from ``megarl convert hf-to-mcore`` (its ``hf/`` subdir holds config.json and
    the tokenizer); a run checkpoint ``RUN_DIR/checkpoints/step_N`` (its ``actor/``, configured by
    the run's ``config.yaml``) or that ``actor/`` directory itself. Without ``need_config`` also a
    bare dist checkpoint (``reward_model.checkpoint``, whose config is ``reward_model.hf_config``)."""
    p = Path(path).absolute()
    if (p / "config.json").is_file() and ((p / INDEX).is_file() or any(p.glob("*.safetensors"))):
        return PretrainedSource("hf", p, p, _tokenizer_dir(p))
    if (p / "actor" / "metadata.json").is_file() and (p / "config.yaml").is_file():
        p = p / "actor"
    if (p / "metadata.json").is_file():
        if (p / HF_SUBDIR / "config.json").is_file():
            return PretrainedSource("mcore", p, p / HF_SUBDIR, _tokenizer_dir(p / HF_SUBDIR))
        if (p.parent / "config.yaml").is_file():  # a run's checkpoint: the run's model config

            run = load_config([p.parent / "config.yaml"])
            if run.model.lora.rank:
                raise ConversionError(
                    f"{field}={path} is a LoRA run's checkpoint: it holds the adapters, not the model. Use its export "
                    f"(megarl export-hf RUN_DIR OUT, the merged model), or {field}={run.model.path} (its base) with "
                    f"model.lora.path set to megarl export-hf RUN_DIR OUT --adapter")
            if run.model.hf_config:
                tokenizer = Path(run.data.tokenizer) if run.data.tokenizer else None
                return PretrainedSource("mcore", p, Path(run.model.hf_config), tokenizer)
        if not need_config:
            return PretrainedSource("mcore", p, None, None)
        raise ConversionError(f"{field}={path}: a Megatron dist checkpoint without its HF config "
                              f"(no {HF_SUBDIR}/config.json, no run config.yaml beside it)")
    raise ConversionError(
        f"{field}={path} is neither an HF directory (config.json + *.safetensors) nor a Megatron dist "
        f"checkpoint (metadata.json: `megarl convert hf-to-mcore` output, or a run's checkpoints/step_N)")


def resolve_model_config(model_cfg):
    """``model_cfg`` with ``hf_config`` filled in when unset: ``model.path``'s config, else
    :data:`DEFAULT_HF_CONFIG`."""
    if model_cfg.hf_config:
        return model_cfg
    config = str(locate(model_cfg.path).config) if model_cfg.path else DEFAULT_HF_CONFIG
    return dataclasses.replace(model_cfg, hf_config=config)


# ----------------------------------------------------------------------------- the mapping


def hf_plan(args, vocab_multiple: int, value_head: bool = False, score: bool = True) -> Plan:
    """The converter's plan; with ``value_head`` the scalar head comes from an HF ``score.weight``
    (a sequence-classification checkpoint) instead of the vocabulary projection, or with ``score``
    false from nowhere (a new head on a causal LM's backbone)."""
    if value_head:
        args = dataclasses.replace(args, tie_word_embeddings=True)  # no lm_head rule
    plan = build_plan(args, vocab_multiple)
    if value_head and score:
        plan.items.append(Item("output_layer.weight", (SCORE,), Rule("output_layer.weight", (SCORE,))))
    return plan


def _item_for(sh, items: List[Item]) -> Item:
    if items[0].expert is None:
        return items[0]
    return items[sh.global_offset[0]]  # stacked experts: the leading axis is the expert index


def _region(sh) -> tuple:
    """The slice of the (per-expert, for stacked experts) global tensor this shard holds."""
    skip = sh.prepend_axis_num
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset[skip:], sh.local_shape))


def _expected_hf_shapes(sh, item: Item) -> List[tuple]:
    # experts stacked on both sides (GptOss): the HF tensors hold every expert
    shape = tuple(sh.global_shape[0 if item.rule.stacked else sh.prepend_axis_num:])
    if item.part is not None:  # one part of the rule's tensor: the HF tensors make the whole
        shape = (sum(rows for _, rows in item.rule.parts),) + shape[1:]
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
    """This shard's part of its global Megatron tensor, reading only the HF rows it needs where
    the transform keeps rows in place (plain copies, vocabulary padding, gate/up stacking)."""
    item = _item_for(sh, items)
    region = _region(sh)
    transform = item.rule.transform
    if item.part is not None:  # the whole tensor, then this part's rows
        start, stop = item.rule.part_rows(item.part)
        return transform.to_mcore([hf.read(name) for name in item.hf_names])[start:stop][region]
    if item.rule.stacked:  # this shard's expert (the leading axis) from each stacked HF tensor
        expert = sh.global_offset[0]
        one = transform.to_mcore([hf.read(name, (slice(expert, expert + 1),)) for name in item.hf_names])
        return one[0][region]
    if transform is IDENTITY:
        return hf.read(item.hf_names[0], region)
    rows, rest = region[0], region[1:]
    if isinstance(transform, VocabPad):  # real rows, then zero padding rows
        real = hf.read(item.hf_names[0], (slice(min(rows.start, transform.vocab), min(rows.stop, transform.vocab)),) + rest)
        return torch.nn.functional.pad(real, (0,) * (2 * len(rest)) + (0, rows.stop - rows.start - real.shape[0]))
    if isinstance(transform, GateUp):  # [gate; up] on rows: a shard's rows lie in one or both
        half = hf.shape(item.hf_names[0])[0]
        parts = []
        for i, name in enumerate(item.hf_names):
            lo, hi = max(rows.start - i * half, 0), min(rows.stop - i * half, half)
            if lo < hi:
                parts.append(hf.read(name, (slice(lo, hi),) + rest))
        return torch.cat(parts, dim=0)
    full = transform.to_mcore([hf.read(name) for name in item.hf_names])
    return full[region]


def _raise_if_any(errors: List[str]) -> None:
    """Collective: every rank raises if any rank found a problem (rank 0's message first)."""
    gathered: List[Optional[List[str]]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, errors)
    found = [f"rank {r}: {e}" for r, errs in enumerate(gathered) for e in (errs or [])]
    if found:
        more = f" (+{len(found) - 3} more)" if len(found) > 3 else ""
        raise ConversionError("; ".join(found[:3]) + more)


def fill_from_hf(state: Dict, plan: Plan, hf: HFCheckpoint, model_type: str, keep=()) -> None:
    """Copy HF tensors into the tensors of a per-layer sharded state dict
    (``sharded_state_dict(chunks, layer_keys="per_layer")``), in place; those named in ``keep``
    keep their values (a new head's initialisation). Collective: every name and shape is checked
    on every rank before any weight is read, and all ranks raise together."""
    by_key = plan.by_mcore_key()
    shards = [sh for sh in sharded_tensors(state) if sh.key not in keep]
    errors = []
    for sh in shards:
        if sh.key == VALUE_HEAD_BIAS and sh.key not in by_key:
            continue  # an HF score head has no bias: zeroed below
        if sh.key not in by_key:
            errors.append(f"Megatron tensor '{sh.key}' has no rule in the {model_type} table")
            continue
        errors += _check_shapes(sh, by_key[sh.key], hf)
    _raise_if_any(errors)
    with torch.no_grad():
        for sh in shards:
            if sh.key in by_key:
                sh.data.copy_(_read_slice(sh, by_key[sh.key], hf))
            else:
                sh.data.zero_()


# ----------------------------------------------------------------------------- loading


NEW_HEAD = ("output_layer.weight", VALUE_HEAD_BIAS)  # a value head a causal LM's checkpoint lacks


def load_pretrained(chunks: List[torch.nn.Module], path: str | Path, args, vocab_multiple: int,
                    value_head: bool = False, new_head: bool = False) -> None:
    """Fill this rank's model chunks (not yet wrapped in DDP) from ``path``, anything
    :func:`locate` accepts. Collective over the world. ``new_head`` (with ``value_head``): a
    source without a scalar head (a causal LM: its vocabulary projection is not read) leaves the
    value head as initialised; a source with one (an HF ``score.weight``, a value-head dist
    checkpoint) fills it."""
    source = locate(path, need_config=False)
    if source.kind == "mcore":
        head = verify_dist_checkpoint(source.weights).state_dict_metadata.get("output_layer.weight")
        has_head = head is not None and head.size[0] == 1
        load_model(chunks, source.weights, skip=NEW_HEAD if value_head and new_head and not has_head else ())
        return
    hf = HFCheckpoint(source.weights)
    score = not (new_head and SCORE not in hf.names())
    keep = () if score or not value_head else NEW_HEAD
    fill_from_hf(sharded_state_dict(chunks, layer_keys="per_layer"), hf_plan(args, vocab_multiple, value_head, score),
                 hf, args.model_type, keep=keep)


# ----------------------------------------------------------------------------- pre-flight


@contextmanager
def _world_of_one():
    """A one-process gloo world with its Megatron groups, for building a model on the meta device
    in a process that is not part of any training world (the driver, before Ray starts)."""
    cpu_mode.enable()
    share_gloo_device()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    groups = build_groups(Layout())
    try:
        yield groups
    finally:
        groups.destroy()
        torch.distributed.destroy_process_group()


def expected_shards(model_cfg, args, value_head: bool = False, layer_keys: str = "per_layer") -> List:
    """The model's ShardedTensors at tp=pp=1 on the meta device (global names and shapes; no
    memory), keyed as ``dist_ckpt.sharded_state_dict(layer_keys=...)``. Runs in a process
    without a training world."""
    assert not torch.distributed.is_initialized(), "expected_shards runs outside a training world"
    with _world_of_one() as groups, torch.device("meta"):
        chunks = build_model(model_cfg, groups, args, initialize=False)
        if value_head:
            attach_value_head(chunks)
        return sharded_tensors(sharded_state_dict(chunks, layer_keys=layer_keys))


def check_pretrained(path: str | Path, model_cfg, field: str = "model.path", value_head: bool = False) -> PretrainedSource:
    """Check ``path`` against ``model_cfg`` (hf_config resolved) before any process starts: every
    file present and complete, every tensor named, shaped and typed as the config implies.
    Raises :class:`ConversionError` naming the file or tensor."""
    source = locate(path, field, need_config=False)
    args = megatron_args_from_hf(model_cfg.hf_config)
    if value_head:
        args = dataclasses.replace(args, tie_word_embeddings=False)
    if source.kind == "hf":
        shards = expected_shards(model_cfg, args, value_head)
        _check_hf(source.weights, args, model_cfg.make_vocab_size_divisible_by, value_head, shards, field,
                  check_finite=getattr(model_cfg, "check_finite", True))
    else:
        _check_mcore(source.weights, model_cfg, args, value_head, field)
    return source


def _check_hf(directory: Path, args, vocab_multiple: int, value_head: bool, shards: List, field: str,
              check_finite: bool = True) -> None:
    try:
        hf = HFCheckpoint(directory)  # verifies every file: present, headers whole, long enough
    except (ValueError, FileNotFoundError) as exc:
        raise ConversionError(f"{field}: {exc}") from None
    plan = hf_plan(args, vocab_multiple, value_head)
    names = hf.names()
    skipped = skipped_hf_names(args, names)
    if "lm_head.weight" in names and (args.tie_word_embeddings or value_head):
        skipped.append("lm_head.weight")  # a tied copy some checkpoints keep
    check_names(plan, names, skipped, f"{field}={directory}")
    if value_head and hf.shape(SCORE)[0] != 1:
        raise ConversionError(f"{field}={directory}: '{SCORE}' has {hf.shape(SCORE)[0]} labels "
                              f"(num_labels); a reward model needs num_labels == 1")
    bad = sorted({f"'{n}' ({hf.dtype_name(n)})" for n in plan.hf_names() if hf.dtype_name(n) not in LOADABLE_HF_DTYPES})
    if bad:
        raise ConversionError(f"{field}={directory}: {len(bad)} tensor(s) in a dtype megarl cannot load "
                              f"(it loads {', '.join(LOADABLE_HF_DTYPES)}), first {bad[0]}")
    by_key = plan.by_mcore_key()
    problems = [p for sh in shards if sh.key in by_key for p in _check_shapes(sh, by_key[sh.key], hf)]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConversionError(f"{field}={directory}: {problems[0]}{more}")
    if check_finite:
        _check_finite(hf, plan.hf_names(), f"{field}={directory}")


def _check_finite(hf, names, where: str) -> None:
    """Every floating-point tensor of ``names`` holds finite values only (a NaN in a user's weights
    would surface as a sampling error deep in a worker). Reads each tensor once, one at a time."""
    for name in names:
        tensor = hf.read(name)
        if tensor.is_floating_point():
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                raise ConversionError(f"{where}: tensor '{name}' (in {hf.weight_map[name]}) holds {bad} non-finite "
                                      f"value(s) (NaN or inf) of {tensor.numel()}; the checkpoint is damaged or was "
                                      f"saved from a diverged run. Fix or replace it (model.check_finite=false skips "
                                      f"this check)")


def _check_mcore(directory: Path, model_cfg, args, value_head: bool, field: str) -> None:
    try:
        root = manifest_root(directory)
        if root is not None:  # a run checkpoint's role (step_N/actor): its files' hashes
            verify_manifest(root, under=None if root == directory else directory.name)
        # every file present and long enough; the metadata read through the allow-list
        metadata = verify_dist_checkpoint(directory)
    except (ValueError, FileNotFoundError) as exc:
        raise ConversionError(f"{field}: {exc}") from None
    stored = metadata.state_dict_metadata
    # per-layer keys (megarl's run checkpoints) or stacked layers (megatron-core's default)
    for sh in expected_shards(model_cfg, args, value_head, checkpoint_layer_keys(metadata)):
        meta = stored.get(sh.key)
        if meta is None or not hasattr(meta, "size"):
            raise ConversionError(f"{field}={directory} has no tensor '{sh.key}' that the model config needs")
        if tuple(meta.size) != tuple(sh.global_shape):
            raise ConversionError(f"{field}={directory}: '{sh.key}' has shape {list(meta.size)}, the config "
                                  f"implies {list(sh.global_shape)}")
        if meta.properties.dtype not in LOADABLE_DTYPES:
            raise ConversionError(f"{field}={directory}: '{sh.key}' is {meta.properties.dtype}, megarl loads "
                                  f"float32, bfloat16 or float16")


def check_pretrained_sources(cfg) -> None:
    """``model.path`` and the reward model's weights against their configs: files present and
    complete, every tensor's name, shape and dtype (a named ConversionError otherwise)."""
    rm = cfg.reward_model
    if cfg.algorithm.reward_fn == REWARD_MODEL and not (rm.path or rm.checkpoint):
        raise ConfigError("algorithm.reward_fn=model needs reward_model.path (an HF *ForSequenceClassification "
                          "directory) or reward_model.checkpoint (a Megatron dist checkpoint of a backbone with "
                          "a scalar head)")
    if rm.path and rm.checkpoint:
        raise ConfigError("set one of reward_model.path and reward_model.checkpoint, not both")
    if cfg.model.path:
        check_pretrained(cfg.model.path, cfg.model, "model.path")
    if cfg.algorithm.reward_fn == REWARD_MODEL and not rm.generative:  # a judge: megarl.controller.prepare.check_judge
        rm_cfg = dataclasses.replace(cfg.model, path=None, hf_config=rm.hf_config or cfg.model.hf_config)
        field = "reward_model.path" if rm.path else "reward_model.checkpoint"
        check_pretrained(rm.path or rm.checkpoint, rm_cfg, field, value_head=True)
