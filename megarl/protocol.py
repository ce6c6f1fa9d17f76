"""What the driver and the roles exchange: the :class:`Batch` of a step's rows with its named
columns, the :class:`Columns` a verb adds to it, and the verbs each role class declares with
:func:`verb`, with how a worker group dispatches them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch


class Column(enum.Enum):
    """What a :class:`Batch` field holds per row, which says how it travels."""

    TOKEN = "token"
    """[rows, seq, ...], right-padded: an engine input (see :meth:`Batch.engine_inputs`)."""
    ROW = "row"
    """[rows]: one value per row, for the driver (scores, lengths, the row's prompt index)."""
    IDS = "ids"
    """A list of token ids per row, as generated (the rollout dumps')."""


def _column(kind: Column, optional: bool = False):
    return field(default=None, metadata={"column": kind}) if optional else field(metadata={"column": kind})


@dataclass
class Batch:
    """One step's rows: next-token inputs, right-padded, with per-row fields, and the columns
    the training phases add (log-probs, values, advantages; None until then). Built by
    :func:`megarl.trainer.steps.make_batch`; crosses Ray as it is (pickled)."""

    tokens: torch.Tensor = _column(Column.TOKEN)  # [rows, seq] inputs
    labels: torch.Tensor = _column(Column.TOKEN)  # [rows, seq] next tokens
    position_ids: torch.Tensor = _column(Column.TOKEN)  # [rows, seq]
    loss_mask: torch.Tensor = _column(Column.TOKEN)  # [rows, seq] 1 on positions predicting a policy token
    rollout_log_probs: torch.Tensor = _column(Column.TOKEN)  # [rows, seq] the rollout's, 0 off the mask
    lengths: torch.Tensor = _column(Column.ROW)  # real input tokens of each row
    response_lengths: torch.Tensor = _column(Column.ROW)
    scores: torch.Tensor = _column(Column.ROW)  # reward with shaping
    raw_scores: torch.Tensor = _column(Column.ROW)  # the verifier's reward
    index: torch.Tensor = _column(Column.ROW)  # the row's prompt (its group) in the step
    policy_versions: torch.Tensor = _column(Column.ROW)  # the rollout weights' version that generated the row
    prompt_ids: List[List[int]] = _column(Column.IDS)
    response_ids: List[List[int]] = _column(Column.IDS)  # multi-turn: observation tokens included
    policy_version: int = -1
    """The batch's: the actor version it trains (the shuffle seed of its mini-batches)."""
    baseline_scores: Optional[torch.Tensor] = _column(Column.ROW, optional=True)  # ReMax's greedy reward
    routing: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    """Recorded MoE routing, [rows, seq, moe_layers, topk] (-1 past each row's tokens)."""
    old_log_probs: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    ref_log_probs: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    values: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    advantages: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    returns: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    old_values: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    kl_penalty: Optional[torch.Tensor] = _column(Column.ROW, optional=True)  # kl_coef * sum_t KL_t
    nll_weights: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)  # VAPO's positive LM loss
    token_versions: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)
    """Partial rollouts: the policy version that sampled each response token, [rows, seq] (at the
    positions predicting it; -1 elsewhere)."""
    prm_labels: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)  # PRIME: the PRM's outcome label
    process_rewards: Optional[torch.Tensor] = _column(Column.TOKEN, optional=True)  # PRIME: the PRM's token rewards
    routing_metrics: Dict[str, float] = field(default_factory=dict)
    """The old-log-prob pass's routing vs the rollout's (MoE), already reduced over the ranks."""

    def __post_init__(self):
        rows = {name: len(value) for name, value in self.columns().items()}
        if len(set(rows.values())) > 1:
            raise ValueError(f"batch columns disagree on rows: {rows}")

    def columns(self, kind: Optional[Column] = None) -> Dict[str, Any]:
        """The row-aligned fields that are set (of ``kind``), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if "column" in f.metadata and getattr(self, f.name) is not None
                and kind in (None, f.metadata["column"])}

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __or__(self, other: "Columns") -> "Batch":
        """This batch with ``other``'s columns set (replacing any it had)."""
        return replace(self, **other.tensors, routing_metrics={**self.routing_metrics, **other.routing_metrics})

    def rows(self, index) -> "Batch":
        """The rows ``index`` selects (a slice or a tensor of row indices)."""
        picked = {}
        for name, value in self.columns().items():
            if isinstance(value, torch.Tensor):
                picked[name] = value[index]
            else:
                picked[name] = value[index] if isinstance(index, slice) else [value[i] for i in index.tolist()]
        return replace(self, **picked, routing_metrics=dict(self.routing_metrics))

    def chunk(self, parts: int) -> List["Batch"]:
        """``parts`` equal row chunks, in order (one per data-parallel rank)."""
        if len(self) % parts:
            raise ValueError(f"{len(self)} rows do not split over {parts} data-parallel ranks; "
                             f"make the rows per step (prompts x samples) a multiple of {parts}")
        size = len(self) // parts
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(parts)]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """The rows of ``batches`` in order (each with the same columns set); the first's routing metrics."""
        joined = {}
        for name, value in batches[0].columns().items():
            parts = [getattr(b, name) for b in batches]
            joined[name] = torch.cat(parts) if isinstance(value, torch.Tensor) else [row for p in parts for row in p]
        return replace(batches[0], **joined, policy_version=max(b.policy_version for b in batches),
                       routing_metrics=dict(batches[0].routing_metrics))

    def engine_inputs(self) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """The engine's per-token tensors by name (MoE ``routing`` among them), and the row
        lengths; per-row fields (scores, advantages' inputs) stay behind."""
        return self.columns(Column.TOKEN), self.lengths


@dataclass
class Columns:
    """Row-aligned columns to set on a :class:`Batch` (``batch | columns``): a DP verb's output,
    gathered over the DP ranks, or the advantages. Names are Batch fields."""

    tensors: Dict[str, torch.Tensor]
    routing_metrics: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.tensors) - set(BATCH_COLUMNS)
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not Batch columns; they are: {', '.join(BATCH_COLUMNS)}")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @staticmethod
    def concat(parts: Sequence["Columns"]) -> "Columns":
        """The rows of ``parts`` in order; the first's routing metrics (reduced over all ranks)."""
        return Columns({k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors},
                       dict(parts[0].routing_metrics))


BATCH_COLUMNS = tuple(f.name for f in fields(Batch) if "column" in f.metadata)


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
    """DP verbs returning a [rows, ...] tensor: the Batch column it becomes (one of BATCH_COLUMNS)."""
    optimizer_steps: bool = False
    """DP verbs that train: called with the step's PPO mini-batches; they report memory peaks."""
    metrics_prefix: str = ""
    """DP verbs returning metrics: prefix of their names (``critic/``)."""


def verb(dispatch: Dispatch, output: Optional[str] = None, optimizer_steps: bool = False, metrics_prefix: str = ""):
    """Declare a role method as a verb. A DP verb's method takes the engine's inputs
    ``(tensors, lengths, how[, mini])`` (see :meth:`Batch.engine_inputs`); the driver calls it
    with a :class:`Batch` and the worker converts. ALL and ONE verbs take the driver's
    arguments as they are."""
    if output is not None and output not in BATCH_COLUMNS:
        raise ValueError(f"verb output '{output}' is not a Batch column; they are: {', '.join(BATCH_COLUMNS)}")
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
