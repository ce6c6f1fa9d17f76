"""Next-token training of a Megatron GPTModel in any layout: DDP, (distributed) optimizer,
LR schedule and Megatron's pipeline schedules.

Losses are per-token sums divided by the token count of the whole global batch
(``calculate_per_token_loss``), so gradients do not depend on dp, pp or micro-batching.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterator, List, Optional

import torch

from megarl.checkpoint.load import load_pretrained, resolve_model_config
from megarl.models import build_model, megatron_args_from_hf
from megarl.models.value_head import attach_value_head
from megarl.parallel.context import split_for_rank
from megarl.parallel.layout import ParallelGroups
from megarl.runtime.devices import group_device, to_device


@dataclass
class TrainState:
    """A model in its training layout with its optimizer and LR schedule."""

    model: List[torch.nn.Module]  # DDP-wrapped chunks, one per virtual pipeline stage
    optimizer: object  # megatron MegatronOptimizer
    scheduler: object  # megatron OptimizerParamScheduler
    groups: ParallelGroups


def build_train_state(model_cfg, optim_cfg, groups: ParallelGroups, total_steps: int,
                      use_distributed_optimizer: Optional[bool] = None,
                      init_checkpoint: Optional[str] = None, value_head: bool = False) -> TrainState:
    """Model chunks wrapped in Megatron DDP, Megatron's optimizer and LR/WD scheduler.

    ``init_checkpoint``: pretrained weights, anything ``model.path`` accepts (an HF directory or
    a Megatron dist checkpoint, any layout), loaded before DDP copies the parameters into its
    buffers and before the optimizer makes its fp32 main copies. ``value_head``: a scalar head
    instead of the vocabulary (critic), never tied to the embedding.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = optim_cfg.use_distributed_optimizer if use_distributed_optimizer is None else use_distributed_optimizer
    chunks = _build_chunks(model_cfg, groups, init_checkpoint, value_head)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed)
    model = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0, pg_collection=groups.pg)
        for i, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
            weight_decay=optim_cfg.weight_decay, adam_beta1=optim_cfg.adam_beta1,
            adam_beta2=optim_cfg.adam_beta2, adam_eps=optim_cfg.adam_eps,
            clip_grad=optim_cfg.clip_grad, use_distributed_optimizer=distributed,
            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype),
        model, use_gloo_process_groups=False, pg_collection=groups.pg)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim_cfg.lr_warmup_steps else optim_cfg.lr, max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr, lr_warmup_steps=optim_cfg.lr_warmup_steps,
        lr_decay_steps=max(total_steps, optim_cfg.lr_warmup_steps + 1),
        lr_decay_style=optim_cfg.lr_decay_style, start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay, wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, groups=groups)


def build_frozen_state(model_cfg, groups: ParallelGroups, init_checkpoint: Optional[str] = None,
                       value_head: bool = False) -> TrainState:
    """Model chunks for forward passes only (a reference policy, a reward model with
    ``value_head``): no DDP, no optimizer, parameters frozen. ``init_checkpoint`` as in
    :func:`build_train_state` (for a reward model also an HF sequence-classification directory)."""
    chunks = _build_chunks(model_cfg, groups, init_checkpoint, value_head)
    for chunk in chunks:
        chunk.requires_grad_(False)
    return TrainState(model=chunks, optimizer=None, scheduler=None, groups=groups)


def _build_chunks(model_cfg, groups: ParallelGroups, init_checkpoint: Optional[str], value_head: bool):
    """This rank's chunks, randomly initialised or filled from ``init_checkpoint`` (then Megatron's
    random init is skipped: every parameter is loaded)."""
    model_cfg = resolve_model_config(model_cfg)
    args = megatron_args_from_hf(model_cfg.hf_config)
    if value_head:
        args = dataclasses.replace(args, tie_word_embeddings=False)
    chunks = build_model(model_cfg, groups, args, initialize=init_checkpoint is None)
    if value_head:
        attach_value_head(chunks)
    if init_checkpoint:
        load_pretrained(chunks, init_checkpoint, args, model_cfg.make_vocab_size_divisible_by, value_head)
    return chunks


def copy_weights(src: TrainState, dst: TrainState) -> List[str]:
    """Copy ``src``'s weights into ``dst`` (the same layout) wherever a name and shape match, and
    refresh ``dst``'s optimizer copies (fp32 main weights). A reference policy takes everything;
    a critic takes the actor's backbone and keeps its new value head. Returns the names copied."""
    copied = []
    with torch.no_grad():
        for s_chunk, d_chunk in zip(src.model, dst.model):
            theirs = dict(getattr(s_chunk, "module", s_chunk).named_parameters())
            for name, param in getattr(d_chunk, "module", d_chunk).named_parameters():
                if name in theirs and theirs[name].shape == param.shape:
                    param.copy_(theirs[name])
                    copied.append(name)
    if dst.optimizer is not None:
        dst.optimizer.reload_model_params()
    return copied


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    # output_tensor: per-token cross entropy [b, s] from the vocab-parallel head.
    loss_sum = (output_tensor.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}


def _forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"].float())


def micro_batches(batch: Dict[str, torch.Tensor], micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
    """Split this DP rank's batch (tensors [b, s]) into micro-batches of ``micro_batch_size`` rows."""
    rows = batch["tokens"].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows on this data-parallel rank do not split into micro-batches of "
                         f"data.micro_batch_size={micro_batch_size}")
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()}
            for i in range(0, rows, micro_batch_size)]


def pad_sequence_length(batch: Dict[str, torch.Tensor], multiple: int) -> Dict[str, torch.Tensor]:
    """Right-pad [b, s] tensors so s divides by ``multiple`` (sequence and context parallelism
    split the sequence over tp and cp ranks). Padding carries loss_mask 0 and, being after every real token,
    changes no real token's output under causal attention."""
    seq = batch["tokens"].shape[1]
    extra = -seq % multiple
    if extra == 0:
        return batch
    padded = {k: torch.nn.functional.pad(v, (0, extra)) for k, v in batch.items()}
    positions = batch["position_ids"]
    padded["position_ids"] = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1)], dim=1)
    return padded


def dp_shard(batch: Dict[str, torch.Tensor], groups: ParallelGroups) -> Dict[str, torch.Tensor]:
    """This rank's contiguous share of a global batch (same rows on every tp/pp/cp rank)."""
    rows, dp = batch["tokens"].shape[0], groups.layout.dp
    if rows % dp:
        raise ValueError(f"global batch of {rows} sequences is not divisible by dp={dp}")
    per = rows // dp
    return {k: v[groups.dp_rank * per:(groups.dp_rank + 1) * per] for k, v in batch.items()}


def forward_backward(state: TrainState, batch: Dict[str, torch.Tensor], micro_batch_size: int,
                     forward_only: bool = False) -> float:
    """Run Megatron's schedule over this DP rank's ``batch``; returns the global token-mean loss
    (the same number on every rank). Gradients land in the DDP buffers, already reduced."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    layout = state.groups.layout
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    # Context parallelism cuts each sequence into 2·cp chunks, and each rank's share into sp slices.
    multiple = math.lcm(2 * layout.cp, layout.cp * sp) if layout.cp > 1 else sp
    batch = to_device(pad_sequence_length(batch, multiple))  # the step's one move onto this rank's device
    micro = micro_batches(batch, micro_batch_size)
    seq_length = batch["tokens"].shape[1]  # whole sequences: Megatron's schedule divides by cp
    if layout.cp > 1:  # this CP rank's chunks of every sequence; the loss counts its own tokens
        cp_rank = state.groups.pg.cp.rank()
        micro = [{k: split_for_rank(v, [seq_length], layout.cp, cp_rank) for k, v in mb.items()} for mb in micro]
    iterators = [iter(micro) for _ in state.model] if len(state.model) > 1 else iter(micro)
    losses = get_forward_backward_func(layout.pp, layout.vpp)(
        forward_step_func=_forward_step, data_iterator=iterators,
        model=state.model if len(state.model) > 1 else state.model[0],
        num_microbatches=len(micro), seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only, pg_collection=state.groups.pg,
        p2p_communicator=P2PCommunicator(pp_group=state.groups.pg.pp, config=state.model[0].config))
    return global_loss(losses, state.groups)


def global_loss(losses: List[Dict[str, torch.Tensor]], groups: ParallelGroups) -> float:
    """Token-mean loss over all micro-batches and DP ranks, broadcast from the last stage."""
    totals = torch.zeros(2, device=group_device(groups.pg.dp_cp))  # reduced over dp and broadcast over pp
    for item in losses:
        totals += item["lm loss"].float()
    if groups.is_last_stage:
        torch.distributed.all_reduce(totals, group=groups.pg.dp_cp)
    last = torch.distributed.get_global_rank(groups.pg.pp, groups.layout.pp - 1)
    torch.distributed.broadcast(totals, src=last, group=groups.pg.pp)
    return (totals[0] / totals[1].clamp(min=1)).item()


def train_step(state: TrainState, batch: Dict[str, torch.Tensor], micro_batch_size: int) -> Dict[str, float]:
    """One optimizer step on this DP rank's share of the global batch."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    loss = forward_backward(state, batch, micro_batch_size)
    ok, grad_norm, _ = state.optimizer.step()
    if ok:
        state.scheduler.step(increment=1)
    return {"loss": loss, "grad_norm": float(grad_norm or 0.0), "lr": state.optimizer.param_groups[0]["lr"],
            "update_ok": float(ok)}
