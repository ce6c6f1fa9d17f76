"""What a checkpoint holds and what differs between two (``megarl convert inspect``,
checkpoint_tools/inspect.py): a Megatron dist checkpoint's or an HF directory's tensors (names,
shapes, dtypes), layout metadata, conversion record and source config.

Listing reads metadata and headers only. A diff reads one tensor at a time, and a tensor of
stacked layers one layer at a time, so it needs the memory of two of the largest such pieces.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch

from megarl.checkpoint.dist_ckpt import checkpoint_layer_keys, read_tensor, tensor_keys, verify_dist_checkpoint
from megarl.checkpoint.hf_files import HF_SUBDIR
from megarl.checkpoint.hf_io import HFCheckpoint, read_safetensors_header
from megarl.checkpoint.integrity import safe_reader
from megarl.checkpoint.jobs import read_record
from megarl.parallel.layout import Layout

_HF_DTYPES = {"F64": "torch.float64", "F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16",
              "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8",
              "U8": "torch.uint8", "BOOL": "torch.bool"}


@dataclass(frozen=True)
class TensorInfo:
    shape: Tuple[int, ...]
    dtype: str  # torch's name, e.g. "torch.bfloat16"


class DistCheckpoint:
    """A Megatron dist checkpoint (torch_dist), read through the metadata allow-list."""

    kind = "Megatron dist checkpoint"

    def __init__(self, path: Path):
        self.path = path
        self.metadata = verify_dist_checkpoint(path)
        stored = self.metadata.state_dict_metadata
        self.tensors = {k: TensorInfo(tuple(stored[k].size), str(stored[k].properties.dtype))
                        for k in sorted(tensor_keys(self.metadata))}
        self.layer_keys = checkpoint_layer_keys(self.metadata)
        self._reader = None

    def pieces(self, name: str) -> Iterator[Tuple[str, torch.Tensor]]:
        """The tensor, or for stacked layers (``decoder.layers.x`` [layers, ...]) each layer's slice."""
        if self._reader is None:
            self._reader = safe_reader(self.path)
        meta = self.metadata.state_dict_metadata[name]
        if self.layer_keys == "default" and name.startswith("decoder.layers.") and len(meta.size) > 1:
            for layer in range(meta.size[0]):
                yield f"layer {layer}", read_tensor(self._reader, name, meta, layer)
        else:
            yield "", read_tensor(self._reader, name, meta)

    def config_dir(self) -> Optional[Path]:
        return self.path / HF_SUBDIR if (self.path / HF_SUBDIR / "config.json").is_file() else None

    def layout_lines(self) -> List[str]:
        megatron = json.loads((self.path / "metadata.json").read_text())
        layers = ("one key per layer (decoder.layers.N.*)" if self.layer_keys == "per_layer"
                  else "stacked layers (decoder.layers.* [layers, ...], megatron-core's default)")
        backend, version = megatron.get("sharded_backend", "?"), megatron.get("sharded_backend_version", "?")
        lines = [f"format: {backend} (version {version}), {layers}", f"files: {len(list(self.path.glob('*.distcp')))} .distcp"]
        optimizer = len([k for k in self.metadata.state_dict_metadata if k.startswith("optimizer.")])
        if optimizer:
            lines.append(f"optimizer state: {optimizer} entries (not listed)")
        return lines


class HFDirectory:
    """An HF directory of safetensors weights (sharded with an index, or not)."""

    kind = "HF safetensors directory"

    def __init__(self, path: Path):
        self.path = path
        self.hf = HFCheckpoint(path)
        headers = {f: read_safetensors_header(path / f) for f in sorted(set(self.hf.weight_map.values()))}
        self.tensors = {}
        for name in sorted(self.hf.names()):
            info = headers[self.hf.weight_map[name]][name]
            self.tensors[name] = TensorInfo(tuple(info["shape"]), _HF_DTYPES.get(info["dtype"], info["dtype"]))
        self.files = sorted(headers)

    def pieces(self, name: str) -> Iterator[Tuple[str, torch.Tensor]]:
        yield "", self.hf.read(name)

    def config_dir(self) -> Path:
        return self.path

    def layout_lines(self) -> List[str]:
        return [f"files: {len(self.files)} .safetensors"]


def open_checkpoint(path: str | Path):
    """A :class:`DistCheckpoint` (metadata.json) or an :class:`HFDirectory` (config.json + safetensors)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if (path / "metadata.json").is_file():
        return DistCheckpoint(path)
    if (path / "config.json").is_file():
        return HFDirectory(path)
    raise ValueError(f"{path} is neither a Megatron dist checkpoint (metadata.json) nor an HF directory (config.json "
                     f"+ *.safetensors)")


def _bytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * getattr(torch, info.dtype.removeprefix("torch.")).itemsize


def describe(path: str | Path) -> List[str]:
    """The lines ``inspect`` prints for one checkpoint: what it is, its layout metadata, the
    record of the conversion that wrote it, its source config, then every tensor."""
    ckpt = open_checkpoint(path)
    total = sum(_bytes(info) for info in ckpt.tensors.values())
    dtypes = sorted({info.dtype.removeprefix("torch.") for info in ckpt.tensors.values()})
    lines = [f"{ckpt.path}: {ckpt.kind}, {len(ckpt.tensors)} tensors, {total / 1e6:.1f} MB ({', '.join(dtypes)})"]
    lines += ckpt.layout_lines()
    record = read_record(ckpt.path)
    if record is not None:
        layout = f" at {Layout(**record['layout'])}" if record.get("layout") else ""
        lines.append(f"converted: {record.get('direction')} from {record.get('source')} "
                     f"({len(record.get('source_files', {}))} files hashed) by megarl {record.get('megarl_version')} "
                     f"on {record.get('world_size')} ranks{layout}")
    config_dir = ckpt.config_dir()
    if config_dir is not None:
        config = json.loads((config_dir / "config.json").read_text())
        scalars = {k: v for k, v in sorted(config.items()) if isinstance(v, (str, int, float, bool)) or v is None}
        lines.append(f"source config ({config_dir / 'config.json'}): "
                     + ", ".join(f"{k}={v}" for k, v in scalars.items()))
    width = max((len(n) for n in ckpt.tensors), default=0)
    lines += [f"  {name:<{width}}  {info.dtype.removeprefix('torch.'):<8}  {list(info.shape)}"
              for name, info in ckpt.tensors.items()]
    return lines


@dataclass(frozen=True)
class Difference:
    """A tensor that differs between two checkpoints: ``what`` is "only in A", "only in B",
    "shape", "dtype" or "values"; ``max_abs_diff`` where values were compared."""

    name: str
    what: str
    detail: str = ""
    max_abs_diff: Optional[float] = None

    def line(self) -> str:
        value = f" max |a - b| = {self.max_abs_diff:.3g}" if self.max_abs_diff is not None else ""
        return f"  {self.what:<9} {self.name}{value}{'  ' + self.detail if self.detail else ''}"


def _same_bits(s: torch.Tensor, t: torch.Tensor) -> bool:
    """Equal dtype and bytes (so NaNs in the same places count as equal)."""
    if s.dtype != t.dtype:
        return False
    return torch.equal(s, t) or torch.equal(s.contiguous().view(-1).view(torch.uint8),
                                            t.contiguous().view(-1).view(torch.uint8))


def diff(a: str | Path, b: str | Path) -> Tuple[List[Difference], int]:
    """The tensors that differ between checkpoints ``a`` and ``b`` (of one kind): names present in
    one only, shapes, dtypes, values (bit-exact: any difference counts; its max abs difference,
    and for stacked layers the first layer that differs). Returns (differences, tensors compared)."""
    first, second = open_checkpoint(a), open_checkpoint(b)
    if first.kind != second.kind:
        raise ValueError(f"cannot compare {first.path} ({first.kind}) with {second.path} ({second.kind}): their "
                         f"tensor names differ by kind; convert one first")
    found = [Difference(n, "only in A") for n in sorted(first.tensors.keys() - second.tensors.keys())]
    found += [Difference(n, "only in B") for n in sorted(second.tensors.keys() - first.tensors.keys())]
    common = sorted(first.tensors.keys() & second.tensors.keys())
    for name in common:
        x, y = first.tensors[name], second.tensors[name]
        if x.shape != y.shape:
            found.append(Difference(name, "shape", f"{list(x.shape)} vs {list(y.shape)}"))
            continue
        worst, where = None, None  # the largest difference, and the first piece (layer) that differs
        for (piece, s), (_, t) in zip(first.pieces(name), second.pieces(name)):
            if _same_bits(s, t):
                continue
            d = (s.double() - t.double()).abs().max().item() if s.numel() else 0.0
            where = piece if where is None else where
            worst = d if worst is None or math.isnan(d) or d > worst else worst
        if x.dtype != y.dtype:
            found.append(Difference(name, "dtype", f"{x.dtype} vs {y.dtype}", worst))
        elif where is not None:
            found.append(Difference(name, "values", f"(first at {where})" if where else "", worst))
    return found, len(common)


def diff_lines(a: str | Path, b: str | Path) -> Tuple[List[str], bool]:
    """The lines ``inspect A B`` prints, and whether the checkpoints hold the same tensors, bit for bit."""
    found, compared = diff(a, b)
    head = f"A = {a}\nB = {b}"
    if not found:
        return [head, f"same: {compared} tensors, equal names, shapes, dtypes and values"], True
    return [head, f"{len(found)} differences ({compared} tensors in both):"] + [d.line() for d in found], False
