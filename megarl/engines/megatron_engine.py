"""A Megatron model in its training layout and the verbs the RL roles need.

``forward_log_probs`` runs Megatron's pipeline schedule forward-only and returns, per token, the
log-probability of the next token and the entropy of the next-token distribution, computed from
vocabulary-parallel logits (never gathered). ``update`` runs forward-backward with a loss the
role supplies and takes an optimizer step. Both accept fixed-size or token-budget
micro-batches, padded or packed.

Loss normalisation: a role's loss returns an unnormalised sum and its count (tokens or
sequences) per micro-batch; Megatron (``calculate_per_token_loss``) sums the counts over all
micro-batches and data-parallel ranks and divides the gradients by the total, so the update is
the same whatever dp, pp or micro-batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.engines import batching
from megarl.engines.batching import Batch, MicroBatch
from megarl.engines.vocab_parallel import log_prob_and_entropy
from megarl.training.lm import TrainState

# (log_probs [n, s], entropy [n, s], micro-batch tensors) -> (loss sum, count, metric sums);
# for a value head: (values [n, s], None, tensors)
LossFn = Callable[[torch.Tensor, torch.Tensor, Batch], Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]]


@dataclass
class MicroBatching:
    """How a DP rank's rows become micro-batches."""

    micro_batch_size: int = 2
    """Rows per micro-batch (fixed mode)."""
    max_tokens: Optional[int] = None
    """Token budget per micro-batch; set = dynamic mode (micro_batch_size ignored)."""
    packed: bool = False
    """Concatenate real tokens (THD) instead of padding rows."""


class MegatronEngine:
    """One model (actor, critic or reference) in its training layout. ``vocab_size`` None
    means the model ends in a value head (critic): its outputs are values, not log-probs."""

    def __init__(self, state: TrainState, vocab_size: Optional[int]):
        self.state = state
        self.groups = state.groups
        self.vocab_size = vocab_size
        # Micro-batches of different lengths need Megatron to exchange shapes between stages
        # (the interleaved schedule gets equal shapes instead, see micro_batches).
        state.model[0].config.variable_seq_lengths = not state.groups.layout.vpp

    def micro_batches(self, batch: Batch, lengths: torch.Tensor, how: MicroBatching) -> List[MicroBatch]:
        layout = self.groups.layout
        multiple = layout.tp * layout.cp if layout.sequence_parallel and layout.tp > 1 else 1
        if how.max_tokens:
            groups = batching.token_budget_micro_batches(lengths, how.max_tokens)
            if layout.vpp and len(groups) % layout.pp:
                # The interleaved schedule takes micro-batches in groups of pp: rebalance the
                # rows over the next multiple of pp (each under the budget or smaller than before).
                count = -(-len(groups) // layout.pp) * layout.pp
                if count > len(lengths):
                    raise ValueError(f"{len(lengths)} rows cannot fill {count} micro-batches, a multiple of "
                                     f"pp={layout.pp} that virtual pipeline stages need; send more rows per DP rank")
                groups = batching.balance_across_dp(lengths, count)
        else:
            groups = batching.fixed_micro_batches(batch, how.micro_batch_size)
            if layout.vpp and len(groups) % layout.pp:
                raise ValueError(f"{len(groups)} micro-batches per DP rank is not a multiple of pp={layout.pp}, "
                                 f"which virtual pipeline stages need; change the batch or micro_batch_size")
        build = batching.packed if how.packed else batching.padded
        micro = [build(batch, rows, lengths, multiple) for rows in groups]
        if layout.vpp:
            # Megatron's interleaved schedule sends one activation shape for all micro-batches.
            if how.max_tokens and not how.packed:
                raise ValueError("virtual pipeline stages need equal micro-batch shapes: use packed "
                                 "micro-batches or a fixed micro_batch_size with dynamic batching off")
            width = max(m.tensors["tokens"].shape[1] for m in micro)
            micro = [batching.pad_to(m, width) for m in micro]
        return micro

    def _run(self, micro: List[MicroBatch], loss_func, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            logits = model(mb.tensors["tokens"], mb.tensors["position_ids"], None,
                           packed_seq_params=mb.packed_seq_params)
            return logits, partial(loss_func, mb)

        layout, model = self.groups.layout, self.state.model
        iterators = [iter(micro) for _ in model] if len(model) > 1 else iter(micro)
        return get_forward_backward_func(layout.pp, layout.vpp)(
            forward_step_func=forward_step, data_iterator=iterators,
            model=model if len(model) > 1 else model[0], num_microbatches=len(micro),
            seq_length=max(m.tensors["tokens"].shape[1] for m in micro),
            micro_batch_size=max(m.tensors["tokens"].shape[0] for m in micro),
            forward_only=forward_only, pg_collection=self.groups.pg,
            p2p_communicator=P2PCommunicator(pp_group=self.groups.pg.pp, config=model[0].config))

    def _head(self, mb: MicroBatch, output: torch.Tensor, temperature: float):
        """(log-probs, entropy) of the labels from vocabulary-parallel logits, or (values, None)."""
        if self.vocab_size is None:
            return output[..., 0].float(), None  # [n, s]
        group = self.groups.pg.tp if self.groups.layout.tp > 1 else None
        return log_prob_and_entropy(output, mb.tensors["labels"], vocab_size=self.vocab_size,
                                    group=group, temperature=temperature)

    @torch.no_grad()
    def forward_log_probs(self, batch: Batch, lengths: torch.Tensor, how: MicroBatching,
                          temperature: float = 1.0) -> Dict[str, torch.Tensor]:
        """Log-probs of ``batch['labels']`` and entropies (or ``values`` for a value head),
        [rows, seq], on every rank of this data-parallel replica (zeros past each row's length)."""
        rows, seq = batch["tokens"].shape
        micro = self.micro_batches(batch, lengths, how)
        keys = ("values", "unused") if self.vocab_size is None else ("log_probs", "entropy")

        def loss_func(mb, output):
            first, second = self._head(mb, output, temperature)
            second = torch.zeros_like(first) if second is None else second
            return first.new_zeros(()), torch.tensor(1, dtype=torch.int), {keys[0]: first, keys[1]: second}

        for chunk in self.state.model:
            chunk.eval()
        outputs = self._run(micro, loss_func, forward_only=True)
        for chunk in self.state.model:
            chunk.train()
        result = torch.zeros(2, rows, seq)
        if self.groups.is_last_stage:
            for mb, out in zip(micro, outputs):
                result[0, mb.rows] = batching.unpack(out[keys[0]], mb, seq)
                result[1, mb.rows] = batching.unpack(out[keys[1]], mb, seq)
        self._broadcast_from_last_stage(result)
        return {keys[0]: result[0]} if self.vocab_size is None else {keys[0]: result[0], keys[1]: result[1]}

    def update(self, batch: Batch, lengths: torch.Tensor, loss_fn: LossFn, how: MicroBatching,
               temperature: float = 1.0) -> Dict[str, float]:
        """One optimizer step on this DP rank's rows; returns the global loss and metrics."""
        state = self.state
        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()

        def loss_func(mb, output):
            first, second = self._head(mb, output, temperature)
            loss_sum, count, metrics = loss_fn(first, second, mb.tensors)
            report = torch.stack([loss_sum.detach().float(), count.float()]
                                 + [v.detach().float() for v in metrics.values()])
            return loss_sum, count.to(torch.int), {"report": report, "names": list(metrics)}

        outputs = self._run(self.micro_batches(batch, lengths, how), loss_func, forward_only=False)
        ok, grad_norm, _ = state.optimizer.step()
        if ok:
            state.scheduler.step(increment=1)
        return self._metrics(outputs, float(grad_norm or 0.0))

    def _metrics(self, outputs, grad_norm: float) -> Dict[str, float]:
        names = outputs[0]["names"] if outputs else []  # only the last stage has outputs
        width = torch.tensor([len(names)], dtype=torch.float)
        if self.groups.layout.pp > 1:
            last = dist.get_global_rank(self.groups.pg.pp, self.groups.layout.pp - 1)
            dist.broadcast(width, src=last, group=self.groups.pg.pp)
        totals = torch.zeros(2 + int(width.item()))
        if self.groups.is_last_stage:
            for out in outputs:
                totals += out["report"]
            dist.all_reduce(totals, group=self.groups.pg.dp_cp)
        self._broadcast_from_last_stage(totals)
        count = totals[1].clamp(min=1)
        metrics = {"loss": (totals[0] / count).item(), "grad_norm": grad_norm}
        metrics.update({name: (totals[2 + i] / count).item() for i, name in enumerate(names)})
        return metrics

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        if self.groups.layout.pp > 1:
            last = dist.get_global_rank(self.groups.pg.pp, self.groups.layout.pp - 1)
            dist.broadcast(tensor, src=last, group=self.groups.pg.pp)
