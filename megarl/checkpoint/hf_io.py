"""Reading and writing Hugging Face safetensors checkpoints, one tensor (or slice) at a time.

Reads go through ``safe_open`` so a rank touches only the tensors, or row ranges, it needs.
Writes fill shards up to a size limit in a temporary directory; the index and the final names
are written last, and the directory is renamed into place only when everything is there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
_SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")


class CheckpointFileError(ValueError):
    """A checkpoint file that is missing, truncated or corrupt; the message names the file."""


def read_safetensors_header(path: Path) -> Dict[str, dict]:
    """The tensors a safetensors file describes (name -> dtype, shape, data_offsets), after
    checking that the header parses and the file is as long as its last tensor needs."""
    if not path.is_file():
        raise CheckpointFileError(f"{path} is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            raise CheckpointFileError(f"{path} is truncated or not a safetensors file: {size} bytes, "
                                      f"its header claims {length} bytes")
        try:
            header = json.loads(f.read(length))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            ends = {name: int(info["data_offsets"][1]) for name, info in tensors.items()}
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise CheckpointFileError(f"{path} has a corrupt safetensors header: {exc}") from exc
    if ends:
        last = max(ends, key=ends.get)
        if 8 + length + ends[last] > size:
            raise CheckpointFileError(f"{path} is truncated: {size} bytes, but tensor '{last}' ends at "
                                      f"byte {8 + length + ends[last]}")
    return tensors


class HFCheckpoint:
    """A directory with config.json and safetensors weights (sharded with an index, or not).
    Opening it checks every weight file's header and length (:meth:`verify`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path} has no config.json: not a Hugging Face checkpoint directory")
        self.config = _read_json(self.path / "config.json")
        if (self.path / INDEX).is_file():
            weight_map = _read_json(self.path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointFileError(f"{self.path / INDEX} has no 'weight_map'")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path} has no *.safetensors weights")
            weight_map = {key: name for name in files for key in read_safetensors_header(self.path / name)}
        self.weight_map: Dict[str, str] = weight_map
        self._handles: Dict[str, object] = {}
        self.verify()

    def verify(self) -> None:
        """Raise :class:`CheckpointFileError` naming the file (and tensor) if a weight file is
        missing, truncated or has a corrupt header, or lacks a tensor the index puts there.
        Reads only the headers."""
        by_file: Dict[str, List[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in sorted(by_file.items()):
            path = self.path / fname
            if not path.is_file():
                raise CheckpointFileError(f"{path} is missing (it holds '{names[0]}')")
            held = read_safetensors_header(path)
            absent = [n for n in names if n not in held]
            if absent:
                raise CheckpointFileError(f"{path} lacks '{absent[0]}', which {INDEX} puts there")

    def names(self) -> List[str]:
        return list(self.weight_map)

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._handles:
            path = self.path / fname
            if not path.is_file():
                raise FileNotFoundError(f"{path} (holding '{name}') is missing")
            self._handles[fname] = safe_open(path, "pt")
        return self._handles[fname]

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._file(name).get_slice(name).get_dtype()

    def read(self, name: str, region: Optional[Tuple[slice, ...]] = None) -> torch.Tensor:
        """The tensor, or only ``region`` of it (read from disk without the rest)."""
        if region is None:
            return self._file(name).get_tensor(name)
        return self._file(name).get_slice(name)[region]

    def side_files(self) -> List[Path]:
        """config.json, generation config and tokenizer files: everything a conversion keeps but the
        weights (and but the record of the conversion that wrote this directory, if one did)."""
        from megarl.checkpoint.jobs import CONVERSION_RECORD

        return sorted(path for path in self.path.iterdir() if path.is_file() and path.suffix in _SIDE_FILE_SUFFIXES
                      and path.name not in (INDEX, CONVERSION_RECORD))

    def files(self) -> List[Path]:
        """Every file a conversion of this directory reads: the weights, the index, the side files."""
        weights = {self.path / name for name in self.weight_map.values()}
        index = [self.path / INDEX] if (self.path / INDEX).is_file() else []
        return sorted(weights | set(index) | set(self.side_files()))

    def copy_side_files(self, dest: Path) -> None:
        """:meth:`side_files`, copied into ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        for path in self.side_files():
            shutil.copy2(path, dest / path.name)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointFileError(f"{path} is not valid JSON: {exc}") from exc


class ShardWriter:
    """Writes tensors into safetensors files of at most ``max_bytes`` each, named by ``prefix``."""

    def __init__(self, directory: Path, prefix: str, max_bytes: int):
        self.directory, self.prefix, self.max_bytes = directory, prefix, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0
        self._count = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        fname = f"{self.prefix}-{self._count:05d}.safetensors"
        save_file(self.pending, str(self.directory / fname), metadata={"format": "pt"})
        self.weight_map.update({name: fname for name in self.pending})
        self._count += 1
        self.pending, self.pending_bytes = {}, 0


def finalize(tmp: Path, weight_map: Dict[str, str], total_bytes: int) -> None:
    """Rename the shards to ``model-0000i-of-0000N.safetensors`` and write the index."""
    files = sorted(set(weight_map.values()))
    final = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in final.items():
        os.replace(tmp / old, tmp / new)
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {name: final[f] for name, f in sorted(weight_map.items())}}
    (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def parse_size(text: str) -> int:
    """'2GB', '500MB', '123' → bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)
