"""Metrics that say how they combine: a :class:`Metric` carries its value and its
:class:`Reduce`, the way values of micro-batches, data-parallel ranks or sampling rounds become one."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence


class Reduce(enum.Enum):
    """How several values of one metric become one."""

    MEAN = "mean"
    """The mean. Inside an engine's loss: a count-weighted sum, divided by the total count."""
    SUM = "sum"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class Metric:
    """A metric's value (a float, or a 0-dim tensor inside a loss) and how to reduce it."""

    value: Any
    reduce: Reduce = Reduce.MEAN


def reduce_values(values: Sequence[float], how: Reduce) -> float:
    """One value of ``values`` as ``how`` says (a plain mean for MEAN)."""
    if how is Reduce.MAX:
        return max(values)
    if how is Reduce.MIN:
        return min(values)
    if how is Reduce.SUM:
        return sum(values)
    return sum(values) / len(values)


def merge(parts: List[Dict[str, Metric]]) -> Dict[str, float]:
    """Several reports of the same metrics (sampling rounds) as one float each, reduced as declared."""
    return {name: reduce_values([p[name].value for p in parts], metric.reduce)
            for name, metric in (parts[0].items() if parts else ())}
