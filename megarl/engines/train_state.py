"""A Megatron GPTModel in its training layout: model chunks wrapped in Megatron DDP, the
(distributed) optimizer and the LR schedule (:class:`TrainState`), or frozen chunks for
forward passes only. :class:`megarl.engines.megatron_engine.MegatronEngine` runs the steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch

from megarl.checkpoint.load import load_pretrained, resolve_model_config
from megarl.models import build_model, lora, megatron_args_from_hf
from megarl.models.value_head import attach_value_head
from megarl.parallel.layout import ParallelGroups


@dataclass
class TrainState:
    """A model in its training layout with its optimizer and LR schedule."""

    model: List[torch.nn.Module]  # DDP-wrapped chunks, one per virtual pipeline stage
    optimizer: object  # megatron MegatronOptimizer
    scheduler: object  # megatron OptimizerParamScheduler
    groups: ParallelGroups


def build_train_state(model_cfg, optim_cfg, groups: ParallelGroups, total_steps: int,
                      use_distributed_optimizer: Optional[bool] = None,
                      init_checkpoint: Optional[str] = None, value_head: bool = False,
                      reward_head: bool = False) -> TrainState:
    """Model chunks wrapped in Megatron DDP, Megatron's optimizer and LR/WD scheduler.

    ``init_checkpoint``: pretrained weights, anything ``model.path`` accepts (an HF directory or
    a Megatron dist checkpoint, any layout), loaded before DDP copies the parameters into its
    buffers and before the optimizer makes its fp32 main copies. ``value_head``: a scalar head
    instead of the vocabulary (critic), never tied to the embedding; ``reward_head``: that head a
    reward model's (see :func:`_build_chunks`).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = optim_cfg.use_distributed_optimizer if use_distributed_optimizer is None else use_distributed_optimizer
    chunks = _build_chunks(model_cfg, groups, init_checkpoint, value_head, lora_adapters=True, reward_head=reward_head)
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
    expert_grad_norm_over_expert_tp(optimizer, model, groups)
    # choices reach Megatron as plain strings: its scheduler's state is checkpointed (weights_only loads)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim_cfg.lr_warmup_steps else optim_cfg.lr, max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr, lr_warmup_steps=optim_cfg.lr_warmup_steps,
        lr_decay_steps=max(total_steps, optim_cfg.lr_warmup_steps + 1),
        lr_decay_style=str(optim_cfg.lr_decay_style), start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay, wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, groups=groups)


def expert_grad_norm_over_expert_tp(optimizer, model, groups: ParallelGroups) -> None:
    """Megatron gives the expert parameters' optimizer the dense tp group, by which the gradient
    norm counts a parameter that is not tensor-parallel on tp rank 0 only (the others hold
    copies). A routed expert's ``linear_fc2.bias`` (gpt_oss) is not tensor-parallel, and at
    etp=1 < tp each tp rank holds other experts: their biases left the norm on tp rank > 0
    (measured: the grad norm 2.7e-2 off the single process at tp=2·ep=2·etp=1, so clipping and
    the weights after 3 steps differed by 1.7e-5). The expert optimizer counts by expert tp."""
    # get_megatron_optimizer appends the expert-parallel parameters' optimizer (those DDP does not
    # all-reduce over dp) last, when there are any
    subs = getattr(optimizer, "chained_optimizers", [])
    if subs and any(getattr(p, "allreduce", True) is False for chunk in model for p in chunk.parameters()):
        subs[-1].tp_group = groups.pg.expt_tp


def build_frozen_state(model_cfg, groups: ParallelGroups, init_checkpoint: Optional[str] = None,
                       value_head: bool = False) -> TrainState:
    """Model chunks for forward passes only (a reference policy, a reward model with
    ``value_head``): no DDP, no optimizer, parameters frozen. ``init_checkpoint`` as in
    :func:`build_train_state` (for a reward model also an HF sequence-classification directory)."""
    chunks = _build_chunks(model_cfg, groups, init_checkpoint, value_head)
    for chunk in chunks:
        chunk.requires_grad_(False)
    return TrainState(model=chunks, optimizer=None, scheduler=None, groups=groups)


def _build_chunks(model_cfg, groups: ParallelGroups, init_checkpoint: Optional[str], value_head: bool,
                  lora_adapters: bool = False, reward_head: bool = False):
    """This rank's chunks, randomly initialised or filled from ``init_checkpoint`` (then Megatron's
    random init is skipped: every parameter is loaded). ``reward_head`` (with ``value_head``): a
    reward model's head, new on a causal LM's backbone (load_pretrained's ``new_head``) and
    without a trained bias, as HF's ``score``. ``lora_adapters`` with ``model.lora.rank``:
    adapters on a frozen base (a value head stays trainable), filled from ``model.lora.path``."""
    model_cfg = resolve_model_config(model_cfg)
    args = megatron_args_from_hf(model_cfg.hf_config)
    if value_head:
        args = dataclasses.replace(args, tie_word_embeddings=False)
    chunks = build_model(model_cfg, groups, args, initialize=init_checkpoint is None)
    if value_head:
        attach_value_head(chunks)
    if init_checkpoint:
        load_pretrained(chunks, init_checkpoint, args, model_cfg.make_vocab_size_divisible_by, value_head, reward_head)
    lora_cfg = lora.resolve(model_cfg.lora)
    if lora_adapters and lora_cfg.rank:
        lora.apply_lora(chunks, lora_cfg, groups.pg.tp)
        if lora_cfg.path:
            lora.load_peft(chunks, lora.read_peft_adapter(lora_cfg.path), args, lora_cfg.path)
        if value_head:  # the critic: adapters on the backbone, a full value head
            for chunk in chunks:
                if getattr(chunk, "post_process", False):
                    chunk.output_layer.requires_grad_(True)
    if reward_head:  # HF's score has no bias (and a Bradley-Terry loss gives it only rounding, which Adam would scale up)
        for chunk in chunks:
            if getattr(chunk, "post_process", False):
                chunk.output_layer.bias.requires_grad_(False)
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
