"""Supervised next-token training (``megarl train-lm``, the parity tests) as a loss of
:meth:`MegatronEngine.update`, so it gets the engine's micro-batching, packing and non-finite-step guard.

The loss is the cross entropy of ``labels`` summed over ``loss_mask`` and divided by the mask's
count over the whole global batch (``calculate_per_token_loss``), so gradients do not depend on
dp, pp or micro-batching. Its softmax spans the padded vocabulary, as Megatron's cross entropy
does (the loss ``megarl train-lm`` always had); the RL log-probs use the real vocabulary.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.train_state import TrainState
from megarl.parallel.layout import ParallelGroups
from megarl.runtime.devices import to_device


def next_token_loss(log_probs: torch.Tensor, entropy: torch.Tensor,
                    tensors: Tensors) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """The engine's :data:`LossFn`: the masked tokens' cross entropy summed, and their count."""
    mask = tensors["loss_mask"].float()  # [n, s]
    return -(log_probs * mask).sum(), mask.sum(), {}


def engine(state: TrainState, max_bad_steps: int = 3) -> MegatronEngine:
    """An engine over ``state`` whose log-probs span the padded vocabulary (see the module docstring)."""
    chunk = state.model[0]
    while hasattr(chunk, "module"):  # DDP and Float16Module wrappers
        chunk = chunk.module
    return MegatronEngine(state, chunk.vocab_size, max_bad_steps)


def row_lengths(batch: Tensors) -> torch.Tensor:
    """Each row's real tokens [rows]: up to its last trained label (later positions are right padding)."""
    mask = batch["loss_mask"].ne(0)  # [rows, seq]
    positions = torch.arange(1, mask.shape[1] + 1)
    return (mask * positions).amax(1).clamp(min=1)


def train_step(engine: MegatronEngine, batch: Tensors, how: MicroBatching) -> Dict[str, float]:
    """One optimizer step on this DP rank's share of the global batch (tensors [rows, seq]:
    tokens, labels, loss_mask, position_ids): the global token-mean ``loss``, ``grad_norm``, the
    ``lr`` after the step and ``update_ok`` (0 when the step was skipped)."""
    metrics = engine.update(to_device(batch), row_lengths(batch), next_token_loss, how)
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "lr": engine.state.optimizer.param_groups[0]["lr"], "update_ok": 1.0 - metrics["skipped_steps"]}


def forward_backward(engine: MegatronEngine, batch: Tensors, how: MicroBatching) -> float:
    """Gradients of this DP rank's share in the DDP buffers, no step; the global token-mean loss."""
    return engine.forward_backward(to_device(batch), row_lengths(batch), next_token_loss, how)["loss"]


def dp_shard(batch: Tensors, groups: ParallelGroups) -> Tensors:
    """This rank's contiguous share of a global batch (same rows on every tp/pp/cp rank)."""
    rows, dp = batch["tokens"].shape[0], groups.layout.dp
    if rows % dp:
        raise ValueError(f"global batch of {rows} sequences is not divisible by dp={dp}")
    per = rows // dp
    return {k: v[groups.dp_rank * per:(groups.dp_rank + 1) * per] for k, v in batch.items()}
