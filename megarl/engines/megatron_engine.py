"""A Megatron model in its training layout and the verbs the RL roles need.

``forward_log_probs`` runs Megatron's pipeline schedule forward-only and returns, per token, the
log-probability of the next token and the entropy of the next-token distribution, computed from
vocabulary-parallel logits (never gathered). ``update`` runs forward-backward with a loss the
role supplies and takes an optimizer step. Both accept fixed-size or token-budget
micro-batches, padded or packed, and splits an RL step's rows into PPO mini-batches and epochs
(:class:`MiniBatches`), one optimizer step each.

Loss normalisation: a role's loss returns an unnormalised sum and its count (tokens or
sequences) per micro-batch; Megatron (``calculate_per_token_loss``) sums the counts over all
micro-batches and data-parallel ranks and divides the gradients by the total, so the update is
the same whatever dp, pp or micro-batching. A mini-batch is one optimizer step, so its loss is
normalised over the mini-batch.

Context parallelism (cp > 1): every micro-batch is built whole, then each CP rank feeds the
model its share of each sequence (Megatron's load-balanced chunks, :mod:`megarl.parallel.context`).
The per-token log-probs and entropies of the CP ranks are all-gathered back to whole sequences
(differentiably) before the role's loss, so losses that need whole sequences (sequence means,
GSPO's sequence ratio) are exact. Every CP rank then computes the same loss and count: the
counts summed over dp×cp are cp times the tokens, and the gradients, summed over the CP ranks
by the all-gather's backward and over dp×cp by Megatron's DDP, are cp times the gradient too,
so the normalised update is exact; the reported means are unchanged for the same reason.

An optimizer step whose loss or gradients are not finite on any rank is skipped on every rank
(weights, optimizer state and LR schedule untouched) and counted (``skipped_steps``);
``max_bad_steps`` such steps in a row stop the run with :class:`NonFiniteUpdateError`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.engines import batching
from megarl.errors import NonFiniteUpdateError  # noqa: F401 - raised here, caught by megarl.cli
from megarl.engines.batching import MicroBatch, Tensors
from megarl.engines.train_state import TrainState
from megarl.engines.vocab_parallel import log_prob_and_entropy
from megarl.metrics import Metric, Reduce
from megarl.models import routing_replay
from megarl.models.builder import set_aux_loss_copies
from megarl.parallel.context import gather_sequence, split_for_rank
from megarl.runtime import cpu_mode, progress
from megarl.runtime.devices import compute_device

# (log_probs [n, s], entropy [n, s], micro-batch tensors) -> (loss sum, count, metrics); for a
# value head: (values [n, s], None, tensors). Rows are the micro-batch's own, packed or not (a
# packed micro-batch is unpacked for the loss), so per-sequence aggregation works either way. Each metric's value is 0-dim and reduced over
# micro-batches, steps and DP ranks as it says: a MEAN is a count-weighted sum, summed and divided by
# the total count; MAX / MIN are extrema; SUM is summed.
LossFn = Callable[[torch.Tensor, torch.Tensor, Tensors], Tuple[torch.Tensor, torch.Tensor, Dict[str, Metric]]]


@dataclass
class MicroBatching:
    """How a DP rank's rows become micro-batches."""

    micro_batch_size: int = 2
    """Rows per micro-batch (fixed mode)."""
    max_tokens: Optional[int] = None
    """Token budget per micro-batch; set = dynamic mode (micro_batch_size ignored)."""
    packed: bool = False
    """Concatenate real tokens (THD) instead of padding rows (``data.pack_sequences``)."""


@dataclass
class MiniBatches:
    """How one RL step's rows become optimizer steps (PPO's mini-batches and epochs).

    Mini-batches are cut from the global row order (DP rank 0's rows first, as the driver
    chunks a batch), reshuffled each epoch by a generator every rank seeds alike; each DP rank
    trains on its equal share of each mini-batch. So mini-batch k is the same set of rows at any
    dp, and the update is layout-invariant."""

    size: int = 0
    """Sequences per optimizer step over all DP ranks; 0 = the whole batch."""
    epochs: int = 1
    """Passes over the batch, each with a new shuffle."""
    seed: int = 0
    """Shuffle seed of this RL step; epoch e draws from seed * 1000 + e."""

    def __post_init__(self):
        if self.size < 0 or self.epochs < 1:
            raise ValueError(f"mini-batch size {self.size} must be >= 0 (0 = whole batch) and epochs "
                             f"{self.epochs} >= 1")

    def plan(self, rows: int, dp: int, dp_rank: int) -> List[torch.Tensor]:
        """Global row indices (of ``rows``) this DP rank trains on, one tensor per optimizer step."""
        size = self.size or rows
        if rows % size or size % dp:
            raise ValueError(f"a mini-batch of {size} sequences must divide the step's {rows} rows and be a "
                             f"multiple of dp={dp}")
        share = size // dp
        steps = []
        for epoch in range(self.epochs):
            # One mini-batch is the whole batch in any order: no shuffle, each rank its own rows.
            order = torch.arange(rows) if size == rows else torch.randperm(
                rows, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            for start in range(0, rows, size):
                mine = order[start + dp_rank * share: start + (dp_rank + 1) * share]
                steps.append(mine.sort().values)
        return steps


class MegatronEngine:
    """One model (actor, critic or reference) in its training layout. ``vocab_size`` None
    means the model ends in a value head (critic): its outputs are values, not log-probs.
    ``max_bad_steps``: non-finite optimizer steps in a row that stop the run (trainer.max_bad_steps)."""

    def __init__(self, state: TrainState, vocab_size: Optional[int], max_bad_steps: int = 3):
        self.state = state
        self.groups = state.groups
        self.vocab_size = vocab_size
        self.max_bad_steps = max_bad_steps
        self.bad_steps_in_a_row = 0
        # Micro-batches of different lengths need Megatron to exchange shapes between stages
        # (the interleaved schedule gets equal shapes instead, see micro_batches).
        state.model[0].config.variable_seq_lengths = not state.groups.layout.vpp
        if state.groups.layout.cp > 1:  # every CP rank computes the whole loss (see the module docstring)
            set_aux_loss_copies(state.model, state.groups.layout.cp)
        self.routers: Dict[int, list] = {}  # id(model chunk) -> its MoE routers' handles (track_routing)
        self.routing_replay = False
        self.routing_mismatch: Dict[str, float] = {}  # of the last log-prob pass with routing

    def track_routing(self, replay: bool) -> None:
        """Give this model's MoE routers replay handles (megarl.models.routing_replay). A batch's
        ``routing`` (the rollout's experts) is then compared with the trainer's in
        :meth:`forward_log_probs` (``routing_mismatch``), and with ``replay`` it is the routing of
        both the log-prob and the update passes; the gating weights stay live."""
        self.routers = {id(c): h for c, h in zip(self.state.model, routing_replay.attach(self.state.model))}
        self.routing_replay = replay

    def _set_routing(self, count: bool) -> bool:
        """Configure the routers for the next pass; True when it needs the batch's routing."""
        for handles in self.routers.values():
            for handle in handles:
                handle.replay, handle.count = self.routing_replay, count
                handle.mismatched = handle.live_mismatched = handle.compared = 0
        return bool(self.routers) and (self.routing_replay or count)

    def micro_batches(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> List[MicroBatch]:
        layout = self.groups.layout
        # Widths: each sequence splits into 2·cp chunks, and each CP rank's share into tp
        # slices with sequence parallelism.
        cp = layout.cp
        sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
        multiple = math.lcm(2 * cp, cp * sp) if cp > 1 else sp
        if how.max_tokens:
            # The budget is per rank: a CP rank holds 1/cp of every sequence's tokens.
            groups = batching.token_budget_micro_batches(lengths, how.max_tokens * cp)
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
        if how.packed:
            segment = 2 * cp if cp > 1 else 1
            micro = [batching.packed(batch, rows, lengths, multiple, segment) for rows in groups]
        else:
            micro = [batching.padded(batch, rows, lengths, multiple) for rows in groups]
        if layout.vpp:
            # Megatron's interleaved schedule sends one activation shape for all micro-batches.
            if how.max_tokens and not how.packed:
                raise ValueError("virtual pipeline stages need equal micro-batch shapes: use packed "
                                 "micro-batches or a fixed micro_batch_size with dynamic batching off")
            width = max(m.tensors["tokens"].shape[1] for m in micro)
            micro = [batching.pad_to(m, width) for m in micro]
        return micro

    def _run(self, micro: List[MicroBatch], loss_func, forward_only: bool, routing: bool = False):
        """Megatron's schedule over ``micro``; ``routing``: give the routers each micro-batch's
        recorded experts before its forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        layout = self.groups.layout
        sp = (self.groups.tp_rank, layout.tp) if layout.sequence_parallel and layout.tp > 1 else (0, 1)

        config = self.state.model[0].config
        # the router counts real tokens only (the padding mask) for its load-balancing loss and for
        # its expert-bias update (aux-loss-free balancing: DeepSeek-V3, GLM-4.5): neither then
        # depends on the batch's padding or a layout's (CP and SP multiples, packing)
        router_counts = not forward_only and config.num_moe_experts and (
            config.moe_aux_loss_coeff or config.moe_router_enable_expert_bias)
        # On CPU the forward runs without CPU mode's function mode, which costs every torch call
        # (7% of the layout-parity session's time): Megatron's forward names a CUDA device only in
        # context parallelism's RoPE slice (a pinned index moved by .cuda())
        plain = cpu_mode.suspended if layout.cp == 1 else contextlib.nullcontext

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            progress.tick()  # a micro-batch: what the driver's hang check sees advance
            if routing:
                routing_replay.set_targets(self.routers.get(id(model), ()), self._cp_local(mb, "routing"), *sp)
            extra = {"padding_mask": self._padding_mask(mb, model, *sp)} if router_counts else {}
            with plain():
                logits = model(self._cp_local(mb, "tokens"), self._cp_local(mb, "position_ids"), None,
                               packed_seq_params=mb.packed_seq_params, **extra)
            return logits, partial(loss_func, mb)

        model = self.state.model
        iterators = [iter(micro) for _ in model] if len(model) > 1 else iter(micro)
        try:
            return get_forward_backward_func(layout.pp, layout.vpp)(
                forward_step_func=forward_step, data_iterator=iterators,
                model=model if len(model) > 1 else model[0], num_microbatches=len(micro),
                seq_length=max(m.tensors["tokens"].shape[1] for m in micro),
                micro_batch_size=max(m.tensors["tokens"].shape[0] for m in micro),
                forward_only=forward_only, pg_collection=self.groups.pg,
                p2p_communicator=P2PCommunicator(pp_group=self.groups.pg.pp, config=model[0].config))
        finally:
            for handles in self.routers.values():
                routing_replay.clear(handles)

    def _padding_mask(self, mb: MicroBatch, model, sp_rank: int, sp: int) -> torch.Tensor:
        """True on the padding of ``mb`` as this rank feeds it ([n, s] on its CP share), for
        Megatron's router: the load-balancing loss and the expert-bias update then count real
        tokens only, so neither the batch's padding nor a layout's (CP and SP multiples, packing)
        changes them. Megatron splits
        the mask for sequence parallelism at the first pipeline stage only: later stages get
        their slice here."""
        if mb.packed_seq_params is None:
            width = mb.tensors["tokens"].shape[1]
            pad = torch.arange(width).unsqueeze(0) >= mb.lengths.unsqueeze(1)
        else:
            segments = batching.segment_lengths(mb)
            real = mb.lengths.tolist() + [0] * (len(segments) - len(mb.lengths))  # the last may be all padding
            pad = torch.cat([torch.arange(n) >= r for n, r in zip(segments, real)]).unsqueeze(0)
        if self.groups.layout.cp > 1:
            pad = split_for_rank(pad, batching.segment_lengths(mb), self.groups.layout.cp, self.groups.pg.cp.rank())
        while not hasattr(model, "pre_process") and hasattr(model, "module"):  # DDP wrappers
            model = model.module
        if sp > 1 and not model.pre_process:
            share = pad.shape[1] // sp
            pad = pad[:, sp_rank * share:(sp_rank + 1) * share]
        return pad.to(mb.tensors["tokens"].device)

    def _cp_local(self, mb: MicroBatch, key: str) -> torch.Tensor:
        """``mb.tensors[key]`` ([n, s, ...]), or this CP rank's share of its sequences."""
        cp = self.groups.layout.cp
        if cp == 1:
            return mb.tensors[key]
        return split_for_rank(mb.tensors[key], batching.segment_lengths(mb), cp, self.groups.pg.cp.rank())

    def _head(self, mb: MicroBatch, output: torch.Tensor, temperature: float):
        """(log-probs, entropy) of the labels from vocabulary-parallel logits, or (values, None),
        [n, s] whole sequences (gathered over the CP ranks)."""
        if self.vocab_size is None:
            first, second = output[..., 0].float(), None
        else:
            group = self.groups.pg.tp if self.groups.layout.tp > 1 else None
            first, second = log_prob_and_entropy(output, self._cp_local(mb, "labels"), vocab_size=self.vocab_size,
                                                 group=group, temperature=temperature)
        if self.groups.layout.cp == 1:
            return first, second
        segments = batching.segment_lengths(mb)
        return tuple(None if t is None else gather_sequence(t, self.groups.pg.cp, segments, dim=1)
                     for t in (first, second))

    @torch.no_grad()
    def forward_log_probs(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching,
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
        routing = "routing" in batch and self._set_routing(count=True)
        outputs = self._run(micro, loss_func, forward_only=True, routing=routing)
        for chunk in self.state.model:
            chunk.train()
        if routing:
            self.routing_mismatch = self._reduce_routing_mismatch()
        result = torch.zeros(2, rows, seq, device=compute_device())  # broadcast over pp (NCCL on GPUs)
        if self.groups.is_last_stage:
            for mb, out in zip(micro, outputs):
                result[0, mb.rows] = batching.unpack(out[keys[0]], mb, seq)
                result[1, mb.rows] = batching.unpack(out[keys[1]], mb, seq)
        self._broadcast_from_last_stage(result)
        return {keys[0]: result[0]} if self.vocab_size is None else {keys[0]: result[0], keys[1]: result[1]}

    def update(self, batch: Tensors, lengths: torch.Tensor, loss_fn: LossFn, how: MicroBatching,
               temperature: float = 1.0, mini: Optional[MiniBatches] = None) -> Dict[str, float]:
        """Optimizer steps on this DP rank's rows, one per mini-batch and epoch (see
        :class:`MiniBatches`); returns the global loss and metrics over all steps: means over
        all tokens (or sequences) of all steps, extrema over all, ``grad_norm`` the mean over
        steps, ``optimizer_steps`` their number."""
        mini = mini or MiniBatches()
        dp, local_rows = self.groups.layout.dp, batch["tokens"].shape[0]
        if mini.size and mini.size != local_rows * dp:
            if dp > 1:  # mini-batches are cut from the global order: every rank needs every row
                batch, lengths = self._gather_dp(batch, lengths)
            steps = mini.plan(local_rows * dp, dp, self.groups.dp_rank)
        else:
            steps = [torch.arange(local_rows)] * mini.epochs
        reports, grad_norms = [], []
        for rows in steps:
            outputs, grad_norm = self._optimizer_step(batching.take_rows(batch, rows), lengths[rows], loss_fn,
                                                      how, temperature)
            reports.append(self._reduce(outputs))
            grad_norms.append(grad_norm)
        return self._metrics(reports, grad_norms)

    def forward_backward(self, batch: Tensors, lengths: torch.Tensor, loss_fn: LossFn, how: MicroBatching,
                         temperature: float = 1.0) -> Dict[str, float]:
        """Gradients of ``loss_fn`` over this DP rank's ``batch`` in the DDP buffers (reduced over
        the data-parallel ranks), without an optimizer step; returns the global loss and metrics
        as :meth:`update` does (a gradient parity check's single pass)."""
        return self._metrics([self._reduce(self._forward_backward(batch, lengths, loss_fn, how, temperature))], [])

    def _optimizer_step(self, batch: Tensors, lengths: torch.Tensor, loss_fn: LossFn, how: MicroBatching,
                        temperature: float):
        """One forward-backward over ``batch`` and one optimizer step: (outputs, grad norm), the
        grad norm None when the step was skipped (see :meth:`_step_if_finite`)."""
        outputs = self._forward_backward(batch, lengths, loss_fn, how, temperature)
        return outputs, self._step_if_finite(outputs)

    def _forward_backward(self, batch: Tensors, lengths: torch.Tensor, loss_fn: LossFn, how: MicroBatching,
                          temperature: float):
        """Zeroed gradients, then Megatron's schedule forward and backward: its outputs per micro-batch."""
        state = self.state
        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()

        def loss_func(mb, output):
            first, second = self._head(mb, output, temperature)
            tensors = mb.tensors
            if mb.packed_seq_params is not None:  # the loss sees the micro-batch's rows, as padded ones
                width = int(mb.lengths.max())
                first, second = (None if t is None else batching.unpack(t, mb, width) for t in (first, second))
                tensors = {k: v[mb.rows, :width] for k, v in batch.items()}
            loss_sum, count, metrics = loss_fn(first, second, tensors)
            report = torch.stack([loss_sum.detach().float(), count.float()]
                                 + [m.value.detach().float() for m in metrics.values()])
            return loss_sum, count.to(torch.int), {"report": report, "names": list(metrics),
                                                   "reduce": [m.reduce for m in metrics.values()]}

        routing = "routing" in batch and self._set_routing(count=False)
        return self._run(self.micro_batches(batch, lengths, how), loss_func, forward_only=False, routing=routing)

    def _step_if_finite(self, outputs) -> Optional[float]:
        """Megatron's optimizer step and the LR schedule's, unless the loss or a gradient is not
        finite on some rank: then every rank skips the step, zeroes its gradients and returns None.

        Megatron checks gradients only when it scales the loss (fp16): its fp32 optimizer, and bf16
        without a loss scale, step on NaN gradients and return ok. So the check is ours, before the
        step, agreed by all ranks of the model (a max over the model- and data-parallel groups; the
        distributed optimizer's reduce-scattered buffers hold a NaN on the rank it came from). With
        fp16, Megatron's loss scaler owns gradient overflow: it skips the step and lowers the
        scale, which is counted but is not a bad step.
        """
        state, fp16 = self.state, self.state.model[0].config.fp16
        bad = any(not torch.isfinite(out["report"][0]) for out in outputs)  # loss sums, last stage
        if not fp16:
            bad = bad or not all(torch.isfinite(buffer.grad_data).all() for chunk in state.model
                                 for buffer in chunk.buffers + chunk.expert_parallel_buffers)
        flag = torch.tensor([float(bad)], device=compute_device())
        for group in (self.groups.pg.mp, self.groups.pg.dp_cp):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            for chunk in state.model:
                chunk.zero_grad_buffer()
            state.optimizer.zero_grad()
            self.bad_steps_in_a_row += 1
            if self.bad_steps_in_a_row >= self.max_bad_steps:
                raise NonFiniteUpdateError(
                    f"{self.bad_steps_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                    f"(trainer.max_bad_steps={self.max_bad_steps}); each was skipped. Look for inf/NaN in the "
                    f"rewards, advantages or log-probs, or lower optimizer.lr")
            return None
        self.bad_steps_in_a_row = 0
        ok, grad_norm, _ = state.optimizer.step()
        if not ok:  # fp16 overflow: Megatron skipped the step
            return None
        state.scheduler.step(increment=1)
        return float(grad_norm or 0.0)

    def _gather_dp(self, batch: Tensors, lengths: torch.Tensor) -> Tuple[Tensors, torch.Tensor]:
        """Every DP rank's rows, in DP-rank order (the driver's global order)."""
        group, dp = self.groups.pg.dp, self.groups.layout.dp
        rows = torch.tensor([lengths.shape[0]], device=compute_device())
        counts = [torch.zeros_like(rows) for _ in range(dp)]
        dist.all_gather(counts, rows, group=group)
        if len({int(c) for c in counts}) > 1:
            raise ValueError(f"mini-batches need equal row counts on every DP rank, got {[int(c) for c in counts]}")

        def gather(t: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(t) for _ in range(dp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)

        return {k: gather(v) for k, v in batch.items()}, gather(lengths.to(rows.device)).cpu()

    def _reduce_routing_mismatch(self) -> Dict[str, float]:
        """Fractions of the (token, MoE layer) top-k sets of the last log-prob pass, over the whole
        model and batch, that differ from the recorded ones: ``routing_mismatch_frac`` the sets the
        layers used (0 with replay), ``routing_live_mismatch_frac`` those the live router logits
        choose (with replay: what the trainer would have chosen). Each rank counted its stage's
        layers on its tokens (its sequence slice with sequence parallelism; tensor-parallel ranks
        without it count alike, which leaves the fractions unchanged)."""
        handles = [h for hs in self.routers.values() for h in hs]
        counts = torch.tensor([float(sum(getattr(h, name) for h in handles))
                               for name in ("mismatched", "live_mismatched", "compared")],
                              device=compute_device())
        for group in (self.groups.pg.mp, self.groups.pg.dp_cp):
            dist.all_reduce(counts, group=group)
        fractions = (counts[:2] / counts[2].clamp(min=1)).tolist()
        return {"routing_mismatch_frac": fractions[0], "routing_live_mismatch_frac": fractions[1]}

    def _reduce(self, outputs) -> Tuple[torch.Tensor, List[str], List[Reduce]]:
        """One optimizer step's [loss sum, count, metrics...] over micro-batches and DP ranks, on
        every pipeline stage; the metric names and reductions on the last stage (others: [])."""
        names = outputs[0]["names"] if outputs else []  # only the last stage has outputs
        kinds = outputs[0]["reduce"] if outputs else []
        device = compute_device()  # every tensor here meets a collective (NCCL on GPUs)
        width = torch.tensor([len(names)], dtype=torch.float, device=device)
        if self.groups.layout.pp > 1:
            last = dist.get_global_rank(self.groups.pg.pp, self.groups.layout.pp - 1)
            dist.broadcast(width, src=last, group=self.groups.pg.pp)
        totals = torch.zeros(2 + int(width.item()), device=device)
        if self.groups.is_last_stage:
            extrema = torch.tensor([False, False] + [k in _SIGN for k in kinds], device=device)
            sign = torch.tensor([1.0, 1.0] + [_SIGN.get(k, 1.0) for k in kinds], device=device)  # min = -max(-x)
            reports = torch.stack([out["report"] for out in outputs]) * sign  # [micro-batches, width]
            totals = torch.where(extrema, reports.max(0).values, reports.sum(0))
            summed, maxed = totals.clone(), totals.clone()
            dist.all_reduce(summed, group=self.groups.pg.dp_cp)
            if extrema.any():
                dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=self.groups.pg.dp_cp)
            totals = torch.where(extrema, maxed, summed) * sign
        self._broadcast_from_last_stage(totals)
        return totals.cpu(), names, kinds

    @staticmethod
    def _metrics(reports: List[Tuple[torch.Tensor, List[str], List[Reduce]]],
                 grad_norms: List[Optional[float]]) -> Dict[str, float]:
        _, names, kinds = reports[0]
        totals = torch.stack([r[0] for r in reports])  # [steps, 2 + metrics]
        count = totals[:, 1].sum().clamp(min=1)
        taken = [g for g in grad_norms if g is not None]  # None: a skipped step
        metrics = {"loss": (totals[:, 0].sum() / count).item(), "grad_norm": sum(taken) / max(len(taken), 1),
                   "optimizer_steps": float(len(taken)), "skipped_steps": float(len(grad_norms) - len(taken))}
        for i, (name, kind) in enumerate(zip(names, kinds)):
            column = totals[:, 2 + i]
            reduced = {Reduce.MAX: column.max, Reduce.MIN: column.min, Reduce.SUM: column.sum}.get(kind)
            metrics[name] = (reduced() if reduced else column.sum() / count).item()
        return metrics

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        if self.groups.layout.pp > 1:
            last = dist.get_global_rank(self.groups.pg.pp, self.groups.layout.pp - 1)
            dist.broadcast(tensor, src=last, group=self.groups.pg.pp)


# the extrema's sign in the max-reduction (min x = -max(-x)); the other metrics are summed
_SIGN = {Reduce.MAX: 1.0, Reduce.MIN: -1.0}
