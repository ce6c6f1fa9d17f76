"""The batch roles exchange: row-aligned tensors, a few metadata fields, the policy version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

import torch


@dataclass
class Batch:
    """``tensors`` share their first dim (rows); ``meta`` holds per-batch values."""

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)
    policy_version: int = -1

    def __post_init__(self):
        rows = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(rows.values())) > 1:
            raise ValueError(f"batch tensors disagree on rows: {rows}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __or__(self, other: "Batch") -> "Batch":
        """Columns of both (``other`` wins on a clash), metadata merged."""
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta},
                     max(self.policy_version, other.policy_version))

    def select(self, keys: Sequence[str]) -> "Batch":
        return Batch({k: self.tensors[k] for k in keys}, dict(self.meta), self.policy_version)

    def rows(self, index) -> "Batch":
        return Batch({k: v[index] for k, v in self.tensors.items()}, dict(self.meta), self.policy_version)

    def chunk(self, parts: int) -> List["Batch"]:
        """``parts`` equal row chunks, in order (one per data-parallel rank)."""
        if len(self) % parts:
            raise ValueError(f"{len(self)} rows do not split over {parts} data-parallel ranks; "
                             f"make the rows per step (prompts x samples) a multiple of {parts}")
        size = len(self) // parts
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(parts)]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        keys = batches[0].tensors.keys()
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in keys}, dict(batches[0].meta),
                     max(b.policy_version for b in batches))
