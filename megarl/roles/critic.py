"""The critic: per-token values from a value head on the policy's backbone, and its update
with the clipped value loss (PPO2), over a :class:`MegatronEngine` built with ``value_head``.

Input tensors, [rows, seq]: ``tokens``, ``position_ids``, ``loss_mask``, ``old_values``,
``returns``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megarl.algorithms.losses import loss_denominators, value_loss
from megarl.config.schema import AggMode
from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching, MiniBatches
from megarl.metrics import Metric
from megarl.protocol import Dispatch, verb


@dataclass
class CriticLossConfig:
    """The critic's objective."""

    clip_range: float = 0.2
    """Value clipping around the old values (absolute, in reward units)."""
    agg_mode: AggMode = AggMode.token_mean
    """Loss aggregation over the global batch."""
    max_len: Optional[int] = None
    """Generation budget, needed by ``seq-mean-token-sum-norm``."""


class Critic:
    """The value model in its training layout."""

    def __init__(self, engine: MegatronEngine, loss: CriticLossConfig):
        if engine.vocab_size is not None:
            raise ValueError("the critic's engine needs a value head (build_train_state(value_head=True))")
        self.engine = engine
        self.cfg = loss

    @verb(Dispatch.DP, output="values")
    def compute_values(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        return self.engine.forward_log_probs(batch, lengths, how)["values"]

    def _loss(self, values: torch.Tensor, _unused, t: Tensors):
        mask = t["loss_mask"]
        tokens, seqs = loss_denominators(mask)
        count = tokens if self.cfg.agg_mode == AggMode.token_mean else seqs
        loss, metrics = value_loss(values, t["old_values"], t["returns"], mask, self.cfg.clip_range,
                                   self.cfg.agg_mode, global_tokens=1, global_seqs=1, max_len=self.cfg.max_len)
        return loss, count, {k: Metric(v * count) for k, v in metrics.items()}  # the engine averages

    @verb(Dispatch.DP, optimizer_steps=True, metrics_prefix="critic/")
    def update(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching,
               mini: Optional[MiniBatches] = None) -> Dict[str, float]:
        """Optimizer steps over ``batch`` (this DP rank's rows), one per mini-batch and epoch;
        the old values stay fixed over all of them."""
        return self.engine.update(batch, lengths, self._loss, how, mini=mini)
