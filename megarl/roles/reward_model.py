"""A reward model: a Megatron backbone with a scalar head (frozen), scoring each sequence by
the head's output at its last token (for an HF sequence-classification model: its last non-pad
token, as transformers picks it)."""

from __future__ import annotations

from typing import Optional

import torch

from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.protocol import Dispatch, verb


def score_positions(tokens: torch.Tensor, lengths: torch.Tensor, pad_token_id: Optional[int]) -> torch.Tensor:
    """[rows]: where each row is scored. transformers' ``*ForSequenceClassification`` takes the
    rightmost token that is not ``pad_token_id`` (the last one when it is None, batch size 1
    only). megarl's rows are right-padded with ``lengths`` real tokens, so this is ``lengths - 1``
    unless the row's own last tokens equal the pad id (e.g. a pad id shared with EOS): those are
    skipped too, as transformers skips them."""
    if pad_token_id is None:
        return (lengths - 1).clamp(min=0)
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    real = (positions < lengths.unsqueeze(1)) & (tokens != pad_token_id)
    return (positions * real).argmax(dim=1)  # 0 when a row has no real non-pad token, as transformers


class RewardModel:
    """Scores of whole sequences (prompt + response) in the reward model's layout.
    ``pad_token_id``: the HF config's pad id of a sequence-classification model (see
    :func:`score_positions`); None scores at ``lengths - 1`` (Megatron reward checkpoints)."""

    def __init__(self, engine: MegatronEngine, pad_token_id: Optional[int] = None):
        if engine.vocab_size is not None or engine.state.optimizer is not None:
            raise ValueError("the reward model's engine needs a value head and no optimizer "
                             "(megarl.engines.train_state.build_frozen_state(value_head=True))")
        self.engine, self.pad_token_id = engine, pad_token_id

    @verb(Dispatch.DP, output="scores")
    def compute_scores(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        """[rows]: the scalar head at each row's scored position (:func:`score_positions`)."""
        values = self.engine.forward_log_probs(batch, lengths, how)["values"]  # [rows, seq]
        where = score_positions(batch["tokens"], lengths.to(values.device), self.pad_token_id)
        return values.gather(1, where.unsqueeze(1)).squeeze(1)
