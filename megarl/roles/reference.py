"""The reference policy: frozen, forward-only log-probs for the KL term."""

from __future__ import annotations

import torch

from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.protocol import Dispatch, verb


class Reference:
    """A frozen copy of the initial policy in its own layout."""

    def __init__(self, engine: MegatronEngine, temperature: float = 1.0):
        if engine.state.optimizer is not None:
            raise ValueError("the reference's engine must be frozen (megarl.engines.train_state.build_frozen_state)")
        self.engine = engine
        self.temperature = temperature

    @verb(Dispatch.DP, output="ref_log_probs")
    def compute_log_prob(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        return self.engine.forward_log_probs(batch, lengths, how, self.temperature)["log_probs"]
