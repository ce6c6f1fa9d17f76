"""A Megatron model in its training layout and the verbs the RL roles need.

``forward_log_probs`` runs Megatron's pipeline schedule forward-only over micro-batches and
returns, for every token, the log-probability of the given next token and the entropy of the
next-token distribution, computed from vocabulary-parallel logits (never gathered).
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List

import torch
import torch.distributed as dist

from megarl.engines.vocab_parallel import log_prob_and_entropy
from megarl.training import lm
from megarl.training.lm import TrainState


class MegatronEngine:
    """One model (actor, critic or reference) in its training layout."""

    def __init__(self, state: TrainState, vocab_size: int):
        self.state = state
        self.groups = state.groups
        self.vocab_size = vocab_size

    def _schedule(self, batch: Dict[str, torch.Tensor], micro_batch_size: int, forward_step, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        layout = self.groups.layout
        if layout.sequence_parallel and layout.tp > 1:
            batch = lm.pad_sequence_length(batch, layout.tp * layout.cp)
        micro = lm.micro_batches(batch, micro_batch_size)
        model = self.state.model
        iterators = [iter(micro) for _ in model] if len(model) > 1 else iter(micro)
        return get_forward_backward_func(layout.pp, layout.vpp)(
            forward_step_func=forward_step, data_iterator=iterators,
            model=model if len(model) > 1 else model[0], num_microbatches=len(micro),
            seq_length=batch["tokens"].shape[1], micro_batch_size=micro_batch_size,
            forward_only=forward_only, pg_collection=self.groups.pg,
            p2p_communicator=P2PCommunicator(pp_group=self.groups.pg.pp, config=model[0].config))

    @torch.no_grad()
    def forward_log_probs(self, batch: Dict[str, torch.Tensor], micro_batch_size: int,
                          temperature: float = 1.0) -> Dict[str, torch.Tensor]:
        """``batch``: this DP rank's tokens, labels, position_ids [b, s]. Returns ``log_probs``
        and ``entropy`` [b, s] (of ``labels``), on every rank of this DP replica."""
        seq = batch["tokens"].shape[1]
        tp_group = self.groups.pg.tp if self.groups.layout.tp > 1 else None

        def loss_func(labels, output):
            # output: [b, s, vocab/tp] logits of this micro-batch
            logp, entropy = log_prob_and_entropy(output, labels, vocab_size=self.vocab_size,
                                                 group=tp_group, temperature=temperature)
            zero = logp.new_zeros(())
            return zero, torch.tensor(1, dtype=torch.int), {"log_probs": logp, "entropy": entropy}

        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            return model(micro["tokens"], micro["position_ids"], None), partial(loss_func, micro["labels"])

        for chunk in self.state.model:
            chunk.eval()
        outputs = self._schedule(batch, micro_batch_size, forward_step, forward_only=True)
        for chunk in self.state.model:
            chunk.train()
        return self._from_last_stage(outputs, batch["tokens"].shape[0], seq)

    def _from_last_stage(self, outputs: List[Dict[str, torch.Tensor]], rows: int, seq: int) -> Dict[str, torch.Tensor]:
        """Concatenate the last stage's micro-batch results and broadcast them over the pipeline."""
        result = torch.zeros(2, rows, seq)
        if self.groups.is_last_stage:
            result[0] = torch.cat([o["log_probs"] for o in outputs])[:, :seq]
            result[1] = torch.cat([o["entropy"] for o in outputs])[:, :seq]
        if self.groups.layout.pp > 1:
            last = dist.get_global_rank(self.groups.pg.pp, self.groups.layout.pp - 1)
            dist.broadcast(result, src=last, group=self.groups.pg.pp)
        return {"log_probs": result[0], "entropy": result[1]}
