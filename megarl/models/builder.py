"""Build Megatron ``GPTModel`` chunks (dense or MoE) from an HF config in a given layout.

Layer specs are declarative: Transformer Engine modules when TE and CUDA are present, else
Megatron's local modules with :class:`SDPACoreAttention` as core attention.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import torch
import torch.nn.functional as F

from megarl.config.schema import ParamsDtype, Recompute, TransformerImpl
from megarl.models.hf_config import MegatronModelArgs, megatron_args_from_hf, padded_vocab_size
from megarl.models.norm import RMSNorm
from megarl.models.sdpa_attention import SDPACoreAttention
from megarl.parallel.layout import Layout, ParallelGroups
from megarl.runtime import cpu_mode

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_engine_available() -> bool:
    """TE is importable and there is a GPU to run it on."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(choice: TransformerImpl) -> bool:
    """Whether to use Transformer Engine for ``model.transformer_impl``."""
    if choice == TransformerImpl.auto:
        return transformer_engine_available()
    if choice == TransformerImpl.transformer_engine:
        if not transformer_engine_available():
            raise ImportError("model.transformer_impl=transformer_engine needs CUDA and Transformer "
                              "Engine: pip install 'megarl[gpu]' on a GPU machine, or use 'local'")
        return True
    if choice == TransformerImpl.local:
        return False
    raise ValueError(f"model.transformer_impl='{choice}' must be one of {TransformerImpl.allowed()}")


def resolve_dtype(choice: ParamsDtype) -> torch.dtype:
    """``model.params_dtype``: ``auto`` is bf16 with CUDA and fp32 on CPU."""
    if choice == ParamsDtype.auto:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if choice not in _DTYPES:
        raise ValueError(f"model.params_dtype='{choice}' must be one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[choice]


def check_layout(args: MegatronModelArgs, layout: Layout, model_cfg, training: bool = True) -> None:
    """Raise :class:`LayoutError` if the model cannot be split as ``layout`` says (pure: call it
    before any process group exists); ``training=False``: an eval-only (generation) model."""
    kw = args.config_kwargs
    layout.validate_model(
        num_layers=kw["num_layers"], num_attention_heads=kw["num_attention_heads"],
        num_query_groups=kw["num_query_groups"], ffn_hidden_size=kw["ffn_hidden_size"],
        padded_vocab_size=padded_vocab_size(args.vocab_size, model_cfg.make_vocab_size_divisible_by),
        num_experts=args.num_experts, moe_ffn_hidden_size=kw.get("moe_ffn_hidden_size"), training=training)
    if kw.get("experimental_attention_variant") == "gated_delta_net":
        from megarl.parallel.layout import LayoutError

        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            if kw[name] % layout.tp:
                raise LayoutError(f"{args.model_type}: tp={layout.tp} must divide the gated delta net's "
                                  f"{name}={kw[name]} (tensor parallelism splits whole heads)")
    if kw.get("experimental_attention_variant") == "gated_delta_net" and layout.cp > 1:
        from megarl.parallel.layout import LayoutError

        raise LayoutError(f"{args.model_type}'s gated delta net layers do not split sequences: context "
                          f"parallelism (cp={layout.cp}) is not supported for them (Megatron has none "
                          f"either); set parallel.cp=1")
    if args.num_experts and kw.get("add_bias_linear") and layout.etp != 1:
        from megarl.parallel.layout import LayoutError

        raise LayoutError(f"{args.model_type}'s experts carry biases, which Megatron splits only with "
                          f"expert tensor parallelism off: etp={layout.etp} must be 1 (set parallel.etp=1; "
                          f"with tp > 1 that needs ep > 1 too)")


def _left_for_loading(weight: torch.Tensor) -> None:
    """The init method of weights about to be loaded: leaves them as allocated."""


def transformer_config(args: MegatronModelArgs, groups: ParallelGroups, model_cfg, initialize: bool = True,
                       training: bool = True):
    """The Megatron TransformerConfig for ``args`` in ``groups.layout``; ``initialize=False``
    skips random initialisation (weights about to be loaded).

    Megatron's tensor-parallel layers mark a weight as tensor-parallel (``tensor_model_parallel``,
    ``partition_dim``: what the gradient norm and the optimizer read to tell shards from
    replicas) only on their initialisation path, so that path always runs; without
    ``initialize`` its init methods leave the weights untouched."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    layout = groups.layout
    kw = args.config_kwargs
    check_layout(args, layout, model_cfg, training)
    dtype = resolve_dtype(model_cfg.params_dtype)
    use_te = resolve_impl(model_cfg.transformer_impl)
    if use_te and kw.get("window_size"):
        from megarl.models.hf_config import UnsupportedModelError

        raise UnsupportedModelError(
            f"a sliding window (window_size={kw['window_size']}) under Transformer Engine is not supported: "
            "TE's window semantics are unverified against transformers; set model.transformer_impl=local "
            "(megarl's SDPA core attention, checked)")
    on_cpu = not torch.cuda.is_available()
    kwargs = dict(kw)
    if not args.mla:
        kwargs.pop("rotary_base")  # a GPTModel argument outside MLA
    if args.num_experts:
        kwargs["moe_token_dispatcher_type"] = str(model_cfg.moe_token_dispatcher)
        if model_cfg.moe_aux_loss_coeff is not None:
            kwargs["moe_aux_loss_coeff"] = model_cfg.moe_aux_loss_coeff
        if kwargs.get("moe_router_enable_expert_bias"):  # 0 by default: the checkpoint's bias kept in RL
            kwargs["moe_router_bias_update_rate"] = model_cfg.moe_router_bias_update_rate
        kwargs["moe_grouped_gemm"] = use_te
        if not kwargs.get("moe_aux_loss_coeff"):
            kwargs["moe_router_load_balancing_type"] = "none"
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    # the architecture table names the activation (default SwiGLU's silu) and whether every
    # linear layer carries a bias (GptOss); both are gated linear units
    activation = {"silu": F.silu, "quick_gelu": quick_gelu}[kwargs.pop("activation_func", "silu")]
    bias = kwargs.pop("add_bias_linear", False)
    cls = MLATransformerConfig if args.mla else TransformerConfig
    config = cls(
        **kwargs,
        **layout.megatron_sizes(),
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=activation,
        add_bias_linear=bias,
        hidden_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        calculate_per_token_loss=True,
        # gloo's batch_isend_irecv mismatches messages when the interleaved (virtual pipeline)
        # schedule posts sends and receives in both directions at once: losses then differ
        # from the single-process run. Single p2p ops are correct there; NCCL batches fine.
        batch_p2p_comm=torch.cuda.is_available(),
        perform_initialization=True,
        **({} if initialize else dict(init_method=_left_for_loading, output_layer_init_method=_left_for_loading,
                                      embedding_init_method=_left_for_loading)),
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=use_te,
        masked_softmax_fusion=use_te,
        persist_layer_norm=use_te,
        apply_rope_fusion=False,
        recompute_granularity=None if model_cfg.recompute_granularity is None else str(model_cfg.recompute_granularity),
        recompute_method="uniform" if model_cfg.recompute_granularity == Recompute.full else None,
        recompute_num_layers=1 if model_cfg.recompute_granularity == Recompute.full else None,
    )
    # A GPT model's YaRN settings are no TransformerConfig fields: GPTModel's YaRN embedding and
    # the attention's concentration factor (mscale) read them off the config as attributes.
    for name, value in (args.yarn or {}).items():
        setattr(config, name, value)
    return config


def _local_replacements() -> dict:
    """Megatron local modules that need CUDA or refuse sequence parallelism → megarl's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    table = {DotProductAttention: SDPACoreAttention, WrappedTorchNorm: RMSNorm}
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        table[FusedLayerNorm] = RMSNorm
    except ImportError:
        pass
    return table


def _localize(spec, table):
    """Copy of a layer spec with every module in ``table`` swapped for its replacement."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        module = table.get(spec.module, spec.module)
        submodules = _localize(spec.submodules, table) if spec.submodules is not None else None
        return dataclasses.replace(spec, module=module, submodules=submodules)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _localize(getattr(spec, f.name), table) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, list):
        return [_localize(s, table) for s in spec]
    if isinstance(spec, type):
        return table.get(spec, spec)
    return spec


def layer_spec(config, use_te: bool, vp_stage: Optional[int], pp_rank: int):
    """The decoder block spec of one pipeline stage (dense and MoE layers interleaved as configured;
    gated delta nets where ``linear_attention_freq`` marks them)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if not use_te:
        cpu_mode.fix_missing_transformer_engine()
    if use_te and config.experimental_attention_variant == "gated_delta_net":
        # Megatron's own hybrid spec (TE linears, fla kernels): unverified here (no GPU)
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec)

        return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage, pp_rank)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                      normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank)
    if use_te:
        return spec
    spec = _localize(spec, _local_replacements())
    if config.experimental_attention_variant == "gated_delta_net":
        spec = _with_gated_delta_nets(spec, config, vp_stage, pp_rank)
    return spec


def _with_gated_delta_nets(spec, config, vp_stage: Optional[int], pp_rank: int):
    """The local block spec with megarl's :class:`GatedDeltaNet` as the token mixer of the layers
    ``linear_attention_freq`` marks. Its input norm stays apart (the local spec fuses none) and
    is saved under Transformer Engine's fused name (``self_attention.in_proj.layer_norm_weight``),
    as Megatron-LM's TE-built hybrid model names it."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.models.gated_delta_net import gated_delta_net_class

    pattern = get_linear_attention_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    mixer = ModuleSpec(module=gated_delta_net_class(), submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear))
    layers = []
    for i, layer in enumerate(spec.layer_specs):
        if pattern[offset + i]:
            keys = dict(layer.submodules.sharded_state_dict_keys_map or {})
            keys = {k: v for k, v in keys.items() if not k.startswith("input_layernorm.")}
            keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(
                layer.submodules, self_attention=mixer, input_layernorm=RMSNorm, sharded_state_dict_keys_map=keys))
        layers.append(layer)
    return dataclasses.replace(spec, layer_specs=layers)


def build_model(model_cfg, groups: ParallelGroups, args: Optional[MegatronModelArgs] = None,
                initialize: bool = True, training: bool = True) -> List[torch.nn.Module]:
    """GPTModel chunks of this rank (one per virtual pipeline stage) for ``model_cfg``;
    ``training=False``: a model that only runs forward in eval mode (see :func:`check_layout`)."""
    from megatron.core.models.gpt import GPTModel

    args = args or megatron_args_from_hf(model_cfg.hf_config)
    config = transformer_config(args, groups, model_cfg, initialize, training)
    use_te = resolve_impl(model_cfg.transformer_impl)
    vocab = padded_vocab_size(args.vocab_size, model_cfg.make_vocab_size_divisible_by)
    layout = groups.layout
    rope = args.rope_scaling or {}
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        first = groups.is_first_stage and vp_stage == 0
        last = groups.is_last_stage and vp_stage == (layout.vpp or 1) - 1
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, use_te, vp, groups.pp_rank),
            vocab_size=vocab,
            max_sequence_length=args.max_position_embeddings,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            position_embedding_type="yarn" if args.yarn else "rope",
            rotary_base=args.config_kwargs["rotary_base"],
            rotary_percent=args.rotary_percent,
            rope_scaling=bool(rope),
            rope_scaling_factor=rope.get("factor", 8.0),
            pg_collection=groups.pg,
            vp_stage=vp,
        ))
    if not config.use_cpu_initialization:
        # Some megatron-core modules allocate on the CPU whatever the config (the MoE router's
        # weight); Megatron's own training loop moves every chunk to the GPU after building it.
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    if training and args.num_experts and config.moe_aux_loss_coeff:
        for chunk in chunks:
            _scale_aux_loss_to_micro_batch(chunk)
    if args.num_experts:
        expert_biases_not_sequence_parallel(chunks)
        biased_experts_unreduced(chunks)
        expert_bias_counts_real_tokens(chunks)
    return chunks


def biased_experts_unreduced(chunks: List[torch.nn.Module]) -> None:
    """A routed expert's ``linear_fc2`` (Megatron's local RowParallelLinear) at expert tp = 1 and
    ep = 1 "all-reduces" its output over its one rank, which returns the matmul's output as a
    view of a custom autograd Function's input; Megatron's MLP then adds a biased expert's bias
    to it in place (``output += bias * per_token_scale``), which autograd forbids: gpt_oss could
    not train (nor take a gradient) at ep=1. With ``explicit_expert_comm`` (what it is at ep > 1)
    the linear skips that reduction over one rank, the same numbers without the view."""
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "is_expert", False) and getattr(module, "explicit_expert_comm", None) is False \
                    and getattr(module, "skip_bias_add", False) and getattr(module, "input_is_parallel", False) \
                    and isinstance(getattr(module, "bias", None), torch.nn.Parameter) and module.tp_group.size() == 1:
                module.explicit_expert_comm = True


def expert_biases_not_sequence_parallel(chunks: List[torch.nn.Module]) -> None:
    """Megatron's local RowParallelLinear tags its bias ``sequence_parallel`` whenever the config
    has sequence parallelism, routed experts' included (TE's linears do not tag expert
    parameters). ``finalize_model_grads`` then sums every tagged gradient over the tensor-parallel
    group: with biased experts (gpt_oss) at tp > 1, etp = 1, ep > 1 the tp ranks hold different
    experts, so each expert's ``linear_fc2.bias`` gradient had another expert's added to it. An
    expert's gradients are whole on its rank and reduced over the expert data-parallel group by
    DDP; the tag is taken off."""
    for chunk in chunks:
        for module in chunk.modules():
            bias = getattr(module, "bias", None)
            if getattr(module, "is_expert", False) and isinstance(bias, torch.nn.Parameter) \
                    and getattr(bias, "sequence_parallel", False):
                bias.sequence_parallel = False


def _tokens_per_expert_and_count(routing_map, reduce_group, topk=None, with_padding_mask=False):
    """Megatron 0.16's ``get_tokens_per_expert_and_token_count`` with the local count kept local:
    its all-reduce runs in place on the local counts, so with a padding mask the "local" number
    of tokens it returns is already the group's."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    local_tokens_per_expert = routing_map.sum(dim=0)
    global_tokens_per_expert = reduce_from_tensor_model_parallel_region(local_tokens_per_expert.clone(), reduce_group)
    if with_padding_mask:
        return (global_tokens_per_expert, local_tokens_per_expert.sum() / topk,
                global_tokens_per_expert.sum() / topk)
    local = routing_map.shape[0]
    return global_tokens_per_expert, local, local * reduce_group.size()


def _attach_aux_loss(router, attach, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                     reduce_group_has_dp=False, valid_token_count=None):
    """Megatron 0.16's router with ``calculate_per_token_loss`` scales each rank's share of a
    load-balancing loss by the rank's own token count (``valid_token_count``), while the main
    loss's gradients are divided by the tokens of the whole micro-batch. A micro-batch split over
    sequence-parallel or context-parallel ranks (the loss's ``tp_cp`` reduce group) therefore got
    1/(tp·cp) of the single process's load-balancing gradient. Scale by the micro-batch's tokens
    over that group instead, so every layout trains the same model (the layout-parity tests
    check it with the loss on). ``router.loss_copies``: how many ranks of the group count each
    loss token (see :func:`set_aux_loss_copies`)."""
    if reduce_group is router.tp_cp_group and reduce_group.size() > 1 and not reduce_group_has_dp:
        if valid_token_count is None:
            valid_token_count = activation.shape[0]
        if torch.is_tensor(valid_token_count):  # a padding mask: ranks may hold different counts
            valid_token_count = valid_token_count.detach().clone()
            torch.distributed.all_reduce(valid_token_count, group=reduce_group)
        else:
            valid_token_count = valid_token_count * reduce_group.size()
        valid_token_count = valid_token_count * getattr(router, "loss_copies", 1)
    return attach(activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                  reduce_group_has_dp=reduce_group_has_dp, valid_token_count=valid_token_count)


def _scale_aux_loss_to_micro_batch(model: torch.nn.Module) -> None:
    from megatron.core.transformer.moe import router as megatron_router
    from megatron.core.transformer.moe.router import TopKRouter

    megatron_router.get_tokens_per_expert_and_token_count = _tokens_per_expert_and_count
    for module in model.modules():
        if isinstance(module, TopKRouter) and module.config.calculate_per_token_loss:
            module.attach_and_log_load_balancing_loss = functools.partial(
                _attach_aux_loss, module, module.attach_and_log_load_balancing_loss)


def expert_bias_counts_real_tokens(chunks: List[torch.nn.Module]) -> None:
    """Megatron 0.16's expert-bias count (aux-loss-free balancing: DeepSeek-V3, GLM-4.5) masks the
    routing map [tokens, experts] with the flat padding mask [tokens] (``routing_map &
    ~padding_mask``), a shape error whenever a mask is given; without one, padding tokens count
    and the bias after a packed update differs from a padded one's. The mask goes per token."""
    from megatron.core.transformer.moe.router import TopKRouter

    def by_token(apply, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return apply(routing_map, None if padding_mask is None else padding_mask.reshape(-1, 1))

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and module.enable_expert_bias:
                module._apply_expert_bias = functools.partial(by_token, module._apply_expert_bias)


def set_aux_loss_copies(chunks: List[torch.nn.Module], copies: int) -> None:
    """A loss that every one of ``copies`` context-parallel ranks computes whole (the RL engine
    gathers log-probs to whole sequences) counts each token ``copies`` times in Megatron's
    per-token normaliser, and its gradients are ``copies`` times too: the load-balancing loss,
    computed on each rank's share, is scaled the same way so that it keeps its weight."""
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.loss_copies = copies
