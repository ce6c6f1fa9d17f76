"""Per-rank GPU memory of a training layout and of its generation layout, computed from a model's
tensors (pure arithmetic, no tensors): what ``megarl plan`` holds against a GPU's memory.

Bytes per rank, N the parameters a rank holds (:meth:`ModelMemory.stage_params`: every
``TensorSpec`` of its pipeline stage, split ones / tp, expert ones / (ep·etp); the embedding on
the first stage, the final norm and output layer on the last, a tied embedding's copy there too):

* parameters: 2·N (bf16; fp32: 4·N). The reference policy (``algorithm.kl_coef`` > 0) adds a
  frozen copy, the critic (ppo, vapo) its own N (a value head instead of the output layer);
* gradients: 4·N, Megatron DDP's fp32 main-gradient buffer (megarl builds it with
  ``grad_reduce_in_fp32``);
* optimizer: Adam's m and v and the fp32 master copy, 12 bytes a parameter (fp32 training: 8,
  the parameter is its own master), sharded by the distributed optimizer over the dp·cp ranks
  for dense parameters and over the expert-data-parallel ranks for experts (Megatron-LM,
  docs/source/api-guide/dist_optimizer.md: 6 + 12/d bytes a parameter for bf16 with fp32 grads);
* activations of one micro-batch of s tokens per CP rank (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", §4, Table 2), per layer:
  s·(18h + 6F)/tp bytes with sequence parallelism, s·(10h + (8h + 6F)/tp) without. 18h + 6F is
  their 34h with the MLP written for a gated (SwiGLU) FFN of width F, as Megatron-LM's
  theoretical_memory_usage.py writes 18h + 4F for an ungated one: fc1's output [gate; up] 4F and
  the product 2F. An MoE layer has k·(2h + 6F_e) for its top-k expert copies (their permuted
  input and FFN; balanced routing assumed) plus 6F_s for a shared expert. Their 5·a·s/h term
  (attention scores, softmax and its dropout) is not stored: flash attention (Transformer
  Engine's fused attention, torch's SDPA) recomputes it, as their selective recompute does.
  1F1B keeps min(pp - stage, m) micro-batches in flight on a stage (m micro-batches per
  optimizer step); the last stage also holds the output layer's input and fp32 logits,
  4·s·(h + V)/tp (Megatron-LM's theoretical_memory_usage.py). With full recompute a stage keeps
  each in-flight micro-batch's layer inputs, 2·s·h/tp per layer (their §4.1), plus one layer's
  activations while it recomputes;
* generation (the rollout engine in layout t_g, p_g, e_g): weights 2·N_g (the generation shard),
  KV cache 2·layers·(kv_heads/t_g)·head_dim·2 bytes a token (MLA: the latent, kv_lora_rank +
  rope dims, on every tp rank; gated-delta-net layers keep no KV cache). vLLM and SGLang hold a
  pool of ``mem_fraction_static`` × the GPU (vLLM's gpu_memory_utilization; see
  megarl/testing/device_memory.py): the KV cache is what the weights leave of it. The native
  engine holds its shard and the KV cache of its rows at full length.

Phases of a colocated step (megarl/controller/rl_worker.py): ``train``: the trained and frozen
states plus activations (the engine released); ``sync``: those states plus the engine's weights
plus one ``bucket_mb`` bucket; ``generate``: the states less what ``trainer.offload`` moves to the
host, plus the engine's pool. The engine's fullest GPU is added to every training stage's (an
upper bound when generation stages differ in size). Not counted: the CUDA context, NCCL buffers,
allocator fragmentation, Megatron's padding of the optimizer's shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megarl.hybrid.shards import ModelSpec
from megarl.models.hf_config import MegatronModelArgs
from megarl.parallel.layout import Layout

GiB = 1 << 30


@dataclass(frozen=True)
class StageParams:
    """Parameters (elements) one rank of a pipeline stage holds."""

    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


@dataclass(frozen=True)
class MicroBatches:
    """The sizes activations depend on."""

    seq_len: int  # tokens of one sequence (prompt + response)
    rows: int  # sequences per micro-batch
    count: int  # micro-batches per DP rank per optimizer step (1F1B's m)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes on one rank of pipeline stage ``stage`` while training."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int  # without recompute
    activations_recompute: int  # with full activation recompute

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    def peak(self, recompute: bool) -> int:
        return self.states + (self.activations_recompute if recompute else self.activations)


@dataclass(frozen=True)
class GenerationMemory:
    """Bytes of the rollout engine on one GPU."""

    weights: int
    kv_per_token: int  # KV-cache bytes of one token on this GPU
    pool: int  # what the engine holds while generating: weights + KV cache
    kv_tokens: int  # the KV cache's capacity in tokens


class ModelMemory:
    """A model's per-layer sizes (elements, activation and KV-cache bytes a token), summed per
    pipeline stage of any layout."""

    def __init__(self, args: MegatronModelArgs, model: ModelSpec):
        kw = args.config_kwargs
        self.model, self.hidden = model, kw["hidden_size"]
        layers = self.num_layers = kw["num_layers"]
        self.split, self.whole = [0] * layers, [0] * layers  # dense elements split over tp, whole
        self.expert_split, self.expert_whole = [0] * layers, [0] * layers  # all experts' elements
        self.first = self.last_split = self.last_whole = 0
        for spec in model.tensors:
            if spec.buffer:
                continue
            if spec.stage == "first":
                self.first += spec.numel
            elif spec.stage == "last":
                if spec.dim is None:
                    self.last_whole += spec.numel
                else:
                    self.last_split += spec.numel
            elif spec.expert is not None:
                (self.expert_whole if spec.dim is None else self.expert_split)[spec.layer] += spec.numel
            else:
                (self.whole if spec.dim is None else self.split)[spec.layer] += spec.numel
        self.vocab = model.tensors[0].shape[0]  # the padded vocabulary: the embedding's rows
        h, topk = self.hidden, kw.get("moe_router_topk", 1)
        shared = kw.get("moe_shared_expert_intermediate_size") or 0
        self.activation = [  # bytes a token of one layer, before tp
            18 * h + (topk * (2 * h + 6 * kw["moe_ffn_hidden_size"]) + 6 * shared if self.expert_split[layer]
                      else 6 * kw["ffn_hidden_size"])
            for layer in range(layers)]
        delta_net = kw.get("linear_attention_freq") if kw.get("experimental_attention_variant") else None
        self.kv_split, self.kv_whole = [0] * layers, [0] * layers  # KV-cache bytes a token (bf16)
        for layer in range(layers):
            if delta_net and delta_net[layer]:
                continue
            if args.mla:
                self.kv_whole[layer] = 2 * (kw["kv_lora_rank"] + kw["qk_pos_emb_head_dim"])
            else:
                self.kv_split[layer] = 2 * 2 * kw["num_query_groups"] * kw["kv_channels"]

    def stage_layers(self, layout: Layout, stage: int) -> range:
        per = self.num_layers // layout.pp
        return range(stage * per, (stage + 1) * per)

    def stage_params(self, layout: Layout, stage: int, value_head: bool = False) -> StageParams:
        """Elements one rank of ``stage`` holds; ``value_head``: the critic's (a scalar head, untied)."""
        layers = self.stage_layers(layout, stage)
        dense = sum(self.split[i] for i in layers) // layout.tp + sum(self.whole[i] for i in layers)
        experts = (sum(self.expert_split[i] for i in layers) // (layout.etp * layout.ep)
                   + sum(self.expert_whole[i] for i in layers) // layout.ep)
        if stage == 0:
            dense += self.first // layout.tp
        if stage == layout.pp - 1:
            dense += self.last_whole
            if value_head:
                dense += self.hidden + 1  # its weight and bias
            else:
                dense += self.last_split // layout.tp
                if self.model.tied_embeddings and layout.pp > 1:  # the output layer's copy
                    dense += self.first // layout.tp
        return StageParams(dense, experts)

    def activations(self, layout: Layout, stage: int, micro: MicroBatches) -> Tuple[int, int]:
        """Activation bytes on one rank of ``stage``: without and with full recompute."""
        tokens = micro.rows * micro.seq_len // layout.cp  # of one micro-batch, on one CP rank
        h, tp = self.hidden, layout.tp
        sp = layout.sequence_parallel or tp == 1

        def layer(i: int) -> float:
            per_token = self.activation[i] / tp if sp else 10 * h + (self.activation[i] - 10 * h) / tp
            return tokens * per_token

        layers = self.stage_layers(layout, stage)
        in_flight = min(layout.pp - stage, micro.count)
        logits = 4 * tokens * (h + self.vocab) / tp if stage == layout.pp - 1 else 0
        full = in_flight * sum(layer(i) for i in layers) + logits
        inputs = in_flight * len(layers) * tokens * 2 * h / (tp if sp else 1)
        recompute = inputs + max(layer(i) for i in layers) + logits
        return int(full), int(recompute)

    def training(self, layout: Layout, stage: int, micro: MicroBatches, param_bytes: int = 2,
                 distributed_optimizer: bool = True, reference: bool = False,
                 critic: bool = False) -> TrainingMemory:
        """One rank of ``stage`` while the actor (and the critic) train; ``reference``: a frozen copy too."""
        trained = [self.stage_params(layout, stage)] + ([self.stage_params(layout, stage, True)] if critic else [])
        frozen = trained[0].total if reference else 0
        state_bytes = 12 if param_bytes < 4 else 8
        dense_shards = layout.dp * layout.cp if distributed_optimizer else 1
        expert_shards = layout.expert_dp if distributed_optimizer else 1
        optimizer = sum(p.dense * state_bytes / dense_shards + p.experts * state_bytes / expert_shards
                        for p in trained)
        full, recompute = self.activations(layout, stage, micro)
        return TrainingMemory(stage, param_bytes * (sum(p.total for p in trained) + frozen),
                              4 * sum(p.total for p in trained), int(optimizer), full, recompute)

    def kv_per_token(self, gen: Layout, stage: int) -> int:
        layers = self.stage_layers(gen, stage)
        return sum(self.kv_split[i] for i in layers) // gen.tp + sum(self.kv_whole[i] for i in layers)

    def generation(self, gen: Layout, pool: Optional[int], tokens: int = 0, param_bytes: int = 2) -> GenerationMemory:
        """The engine's bytes on its fullest GPU in layout ``gen``: in a pool of ``pool`` bytes
        (vLLM, SGLang), or (``pool`` None: the native engine) its weights plus ``tokens`` of KV cache."""
        stages = [(self.stage_params(gen, s).total * param_bytes, self.kv_per_token(gen, s)) for s in range(gen.pp)]
        if pool is None:
            weights, kv = max(stages, key=lambda stage: stage[0] + stage[1] * tokens)
            return GenerationMemory(weights, kv, weights + kv * tokens, tokens)
        # every stage's GPU has a pool of the same size: the fullest stage bounds the cache
        capacity = min(max(0, pool - weights) // max(kv, 1) for weights, kv in stages)
        return GenerationMemory(max(w for w, _ in stages), max(k for _, k in stages), pool, capacity)


def phase_peaks(train: TrainingMemory, gen: GenerationMemory, recompute: bool, offload, bucket: int) -> Dict[str, int]:
    """Bytes of one colocated rank in each phase (see the module docstring); ``offload``: the
    ``trainer.offload`` flags, ``bucket``: a weight sync's bucket in bytes."""
    away = (train.params if offload.params else 0) + (train.grads if offload.grads else 0) \
        + (train.optimizer if offload.optimizer else 0)
    return {"train": train.peak(recompute), "sync": train.states + gen.weights + bucket,
            "generate": train.states - away + gen.pool}
