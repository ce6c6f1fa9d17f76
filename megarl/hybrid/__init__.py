"""3D-HybridEngine: regroup the actor's training shards into its generation layout (HybridFlow §5).

``shards`` says which slice every rank holds, ``planner`` who sends what to whom (pure, cached),
``executor`` moves the bytes bucket by bucket, ``names`` reads a built model's tensor names
(Transformer Engine's spec) as the plans' own.
"""

from megarl.hybrid.executor import P2PTransport, Resharder, SyncStats
from megarl.hybrid.planner import (MODES, Regrouping, ReshardError, ReshardPlan, hybridflow_bytes,
                                   plan_reshard, rank_traffic, regroup)
from megarl.hybrid.shards import ModelSpec, Placement, TensorSpec

__all__ = ["MODES", "ModelSpec", "P2PTransport", "Placement", "Regrouping", "ReshardError", "ReshardPlan",
           "Resharder", "SyncStats", "TensorSpec", "hybridflow_bytes", "plan_reshard", "rank_traffic", "regroup"]
