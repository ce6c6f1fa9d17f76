"""A LoRA run's actor out of its checkpoint: the adapters (the run checkpoint holds only them and
their optimizer state; the base is ``model.path``) as a PEFT adapter directory, or merged into
the base as a Hugging Face directory. Single process, no model built: the adapters are read
whole from the dist checkpoint (any layout it was saved in) and named by the converter's table.

Merged weights are ``(W.float() + (B.float() @ A.float()) * (alpha / r)).to(dtype)`` per adapted
HF module, W from the base's own files; a module trained whole (``model.lora.modules_to_save``)
is the run's; every other tensor is copied as stored (cast to ``dtype`` if another is asked
for). Both write into a temporary directory renamed into place.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors.torch import save_file

from megarl.checkpoint.dist_ckpt import read_tensor, tensor_keys, verify_dist_checkpoint
from megarl.checkpoint.hf_files import write_side_files
from megarl.checkpoint.hf_io import HFCheckpoint, ShardWriter, finalize
from megarl.checkpoint.integrity import safe_reader
from megarl.checkpoint.load import locate
from megarl.models import lora
from megarl.models.hf_config import megatron_args_from_hf

# decoder.layers[.L].<linear key>.lora.<A|B>.<part>: per-layer or stacked (a leading layer axis)
_ADAPTER_KEY = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)\.lora\.([AB])\.(\w+)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peft_tensors(actor_dir: Path, args) -> Dict[str, torch.Tensor]:
    """The adapters of a train-state checkpoint (``RUN/checkpoints/step_N/actor``) under PEFT's
    names (``base_model.model.<HF module>.lora_A.weight``), whole."""
    metadata = verify_dist_checkpoint(actor_dir)
    reader = safe_reader(actor_dir)
    out: Dict[str, torch.Tensor] = {}
    saved = {f"{m}.weight" for m in lora.saved_modules(lora.SAVED)}
    for key in tensor_keys(metadata):
        if key in saved:  # a module trained whole (modules_to_save): PEFT keeps it under its HF name
            out[lora.PEFT_PREFIX + lora.hf_weight(args, key)] = read_tensor(reader, key, metadata.state_dict_metadata[key])
            continue
        m = _ADAPTER_KEY.match(key)
        if not m:
            continue
        layer, linear, factor, part = m.groups()
        tensor = read_tensor(reader, key, metadata.state_dict_metadata[key])
        per_layer = {int(layer): tensor} if layer is not None else dict(enumerate(tensor))
        for index, value in per_layer.items():
            module = lora.hf_modules(args, index, linear)[part]
            out[f"{lora.PEFT_PREFIX}{module}.lora_{factor}.weight"] = value.contiguous()
    if not out:
        raise ValueError(f"{actor_dir} holds no LoRA adapters (keys '...lora.A...'); is it a LoRA run's checkpoint?")
    return out


def write_adapter(out_dir: Path, tensors: Dict[str, torch.Tensor], lora_cfg, base: Optional[str]) -> None:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that peft's
    ``PeftModel.from_pretrained(base_model, out_dir)`` loads as is."""
    parts = sorted({name.split(".lora_")[0].rsplit(".", 1)[1] for name in tensors if ".lora_" in name})
    saved = sorted(name[len(lora.PEFT_PREFIX):-len(".weight")] for name in tensors if ".lora_" not in name)
    config = lora.peft_config(lora_cfg, base, parts, saved)
    with _staged(out_dir) as tmp:
        (tmp / lora.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})


def merged_updates(tensors: Dict[str, torch.Tensor]) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """{HF weight name: (A, B)} of every adapted module, from PEFT-named tensors (modules trained
    whole are not among them: see :func:`whole_modules`)."""
    out = {}
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name[len(lora.PEFT_PREFIX):-len(".lora_A.weight")]
            out[f"{module}.weight"] = (a, tensors[name.replace(".lora_A.", ".lora_B.")])
    return out


def whole_modules(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """{HF weight name: tensor} of the modules trained whole (modules_to_save)."""
    return {name[len(lora.PEFT_PREFIX):]: t for name, t in tensors.items() if ".lora_" not in name}


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """W + (alpha/r) B A in fp32, cast to ``dtype``."""
    return (weight.float() + (b.float() @ a.float()) * scaling).to(dtype)


def write_merged(out_dir: Path, base_dir: Path, tensors: Dict[str, torch.Tensor], lora_cfg, dtype: str,
                 config_file: Path, tokenizer_dir: Optional[Path], max_shard_bytes: int = 2 * 10**9) -> None:
    """The base of ``base_dir`` with the adapters merged in, as an HF directory."""
    base = HFCheckpoint(base_dir)
    updates, whole = merged_updates(tensors), whole_modules(tensors)
    missing = sorted((set(updates) | set(whole)) - set(base.names()))
    if missing:
        raise ValueError(f"the base {base_dir} has no '{missing[0]}', which the adapters update")
    scaling = lora_cfg.alpha / lora_cfg.rank
    with _staged(out_dir) as tmp:
        writer = ShardWriter(tmp, "part", max_shard_bytes)
        written = None
        for name in base.names():
            tensor = base.read(name)
            out_dtype = _DTYPES[dtype] if dtype != "auto" else tensor.dtype
            written = written or out_dtype
            if name in updates:
                tensor = merge(tensor, *updates[name], scaling, out_dtype)
            elif name in whole:  # trained whole: the run's tensor replaces the base's
                tensor = whole[name]
            writer.add(name, tensor.to(out_dtype))
        writer.flush()
        finalize(tmp, writer.weight_map, writer.total_bytes)
        config = json.loads(Path(config_file).read_text())
        write_side_files(tmp, config, written, Path(config_file).parent, tokenizer_dir)


class _staged:
    """A temporary sibling of ``out_dir``, renamed to it on success and removed on failure."""

    def __init__(self, out_dir: Path):
        self.out = Path(out_dir)
        if self.out.exists():
            raise FileExistsError(f"output {self.out} already exists; remove it or choose another path")
        self.tmp = self.out.with_name(self.out.name + ".tmp")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.tmp.rename(self.out)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def export_lora(checkpoint: Path, cfg, out_dir: Path, dtype: str, adapter: bool, config: Path,
                tokenizer: Optional[Path]) -> None:
    """``megarl export-hf`` for a LoRA run: ``adapter`` = the PEFT directory, else merged."""
    from megarl.checkpoint.convert import mcore_to_hf

    config_file = config / "config.json" if config.is_dir() else config
    args = megatron_args_from_hf(str(config_file))
    tensors = peft_tensors(checkpoint / "actor", args)
    lora_cfg = cfg.model.lora
    if adapter:
        write_adapter(out_dir, tensors, lora_cfg, cfg.model.path)
        return
    source = locate(cfg.model.path, "model.path")
    if source.kind == "hf":
        write_merged(out_dir, source.weights, tensors, lora_cfg, dtype, config_file, tokenizer)
        return
    with tempfile.TemporaryDirectory(dir=Path(out_dir).parent) as scratch:  # a Megatron base: to HF first
        base_dir = Path(scratch) / "base"
        mcore_to_hf(source.weights, base_dir, hf_config_dir=config_file.parent, tokenizer_dir=tokenizer, hashes=False)
        write_merged(out_dir, base_dir, tensors, lora_cfg, dtype, config_file, tokenizer)
