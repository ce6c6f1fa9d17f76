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


class HFCheckpoint:
    """A directory with config.json and safetensors weights (sharded with an index, or not)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path} has no config.json: not a Hugging Face checkpoint directory")
        self.config = json.loads((self.path / "config.json").read_text())
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path} has no *.safetensors weights")
            weight_map = {}
            for name in files:
                with safe_open(self.path / name, "pt") as f:
                    weight_map.update({key: name for key in f.keys()})
        self.weight_map: Dict[str, str] = weight_map
        self._handles: Dict[str, object] = {}

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

    def copy_side_files(self, dest: Path) -> None:
        """config.json, generation config and tokenizer files (everything but the weights)."""
        dest.mkdir(parents=True, exist_ok=True)
        for path in self.path.iterdir():
            if path.is_file() and path.suffix in _SIDE_FILE_SUFFIXES and path.name != INDEX:
                shutil.copy2(path, dest / path.name)


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
