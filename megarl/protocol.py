"""What the driver and the roles exchange: the :class:`Batch` of row-aligned tensors, and the
verbs each role class declares with :func:`verb`, with how a worker group dispatches them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

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

    def engine_inputs(self):
        """The engine's [rows, seq] tensors (and MoE ``routing``), and the row lengths; per-row
        fields (scores, advantages' inputs) stay behind."""
        return {k: v for k, v in self.tensors.items() if v.dim() == 2 or k == "routing"}, self["lengths"]


class Dispatch(enum.Enum):
    """How a worker group runs a verb over its ranks."""

    DP = "dp"
    """Each rank gets its data-parallel index's row chunk of the batch (every TP/PP rank of one
    DP index the same chunk); the result is gathered from the collecting rank of each DP index
    (TP rank 0 and CP rank 0 of the last pipeline stage): Batches concatenated in DP order, a dict (metrics,
    already reduced) from DP index 0."""
    ALL = "all"
    """Every rank runs it with the same arguments (a collective); rank 0's result."""
    ONE = "one"
    """Rank 0 alone runs it (no collective inside); its result."""


@dataclass(frozen=True)
class Verb:
    """A role method the driver may call, and how (see :func:`verb`)."""

    dispatch: Dispatch
    output: Optional[str] = None
    """DP verbs returning a [rows, ...] tensor: the Batch column it becomes."""
    optimizer_steps: bool = False
    """DP verbs that train: called with the step's PPO mini-batches; they report memory peaks."""
    metrics_prefix: str = ""
    """DP verbs returning metrics: prefix of their names (``critic/``)."""


def verb(dispatch: Dispatch, output: Optional[str] = None, optimizer_steps: bool = False, metrics_prefix: str = ""):
    """Declare a role method as a verb. A DP verb's method takes the engine's inputs
    ``(tensors, lengths, how[, mini])`` (see :meth:`Batch.engine_inputs`); the driver calls it
    with a :class:`Batch` and the worker converts. ALL and ONE verbs take the driver's
    arguments as they are."""
    spec = Verb(dispatch, output, optimizer_steps, metrics_prefix)

    def mark(method):
        method.__verb__ = spec
        return method

    return mark


def declared_verbs(cls) -> Dict[str, Verb]:
    """The verbs of a role class, its bases' included (a subclass may redeclare one)."""
    out: Dict[str, Verb] = {}
    for klass in reversed(cls.__mro__):
        out.update({name: v.__verb__ for name, v in vars(klass).items() if hasattr(v, "__verb__")})
    return out
