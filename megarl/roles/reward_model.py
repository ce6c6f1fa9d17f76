"""A reward model: a Megatron backbone with a scalar head (frozen), scoring each sequence by
the head's output at its last token."""

from __future__ import annotations

import torch

from megarl.engines.batching import Batch
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching


class RewardModel:
    """Scores of whole sequences (prompt + response) in the reward model's layout."""

    def __init__(self, engine: MegatronEngine):
        if engine.vocab_size is not None or engine.state.optimizer is not None:
            raise ValueError("the reward model's engine needs a value head and no optimizer "
                             "(lm.build_frozen_state(value_head=True))")
        self.engine = engine

    def compute_scores(self, batch: Batch, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        """[rows]: the scalar head at each row's last real token (index ``lengths - 1``)."""
        values = self.engine.forward_log_probs(batch, lengths, how)["values"]  # [rows, seq]
        return values.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
