"""An analytic cost model of one RL step on a GPU cluster: generation, training and weight-sync
seconds of a training layout and its generation layout. ``megarl plan`` ranks layouts by it;
benchmarks/scaling.py prints it for reference models (and checks a CPU instance of it).

Generation: each generation replica decodes its rows; a decode step streams the replica's weights
or is compute-bound (KV-cache reads and attention FLOPs are left out: a lower bound). Training:
``flops_per_param_token`` × active params × tokens at ``train_mfu`` over every GPU (2 per forward,
4 per backward: the old log-probs and the update of GRPO make 2 + 6), times the 1F1B pipeline
bubble 1 + (pp - 1) / m for m micro-batches when they are given (Narayanan et al. 2021, §2.2).
Weight sync: the 3D-HybridEngine planner's bytes for rank 0, same node over NVLink and other nodes
over InfiniBand. Phases do not overlap; tensor-parallel and expert all-to-all traffic is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megarl.hybrid import ModelSpec, Regrouping, rank_traffic, regroup
from megarl.parallel.layout import Layout


@dataclass(frozen=True)
class Hardware:
    name: str = "H100 SXM"
    peak_tflops: float = 989.0  # dense bf16
    hbm_tbps: float = 3.35
    nvlink_gbps: float = 450.0  # per GPU, one direction
    ib_gbps: float = 50.0  # per GPU (400 Gb/s)
    gpus_per_node: int = 8
    train_mfu: float = 0.40  # forward+backward
    prefill_mfu: float = 0.50
    decode_hbm_efficiency: float = 0.60  # of HBM bandwidth while streaming weights and KV


@dataclass(frozen=True)
class Workload:
    prompts: int = 512
    samples: int = 8
    prompt_tokens: int = 512
    response_tokens: int = 2048
    bytes_per_param: int = 2


@dataclass(frozen=True)
class ParamCounts:
    """Elements of a model: all of them, the non-expert ones, and those one token runs through."""

    total: int
    dense: int
    active: float

    @property
    def experts(self) -> int:
        return self.total - self.dense

    @classmethod
    def of(cls, model: ModelSpec, topk: int) -> "ParamCounts":
        """``topk``: experts per token (``moe_router_topk``; 1 for a dense model)."""
        total = model.numel()
        dense = sum(t.numel for t in model.tensors if t.expert is None)
        active = dense + ((total - dense) * topk / model.num_experts if model.num_experts else 0)
        return cls(total, dense, active)


def generation_seconds(counts: ParamCounts, gen: Layout, hw: Hardware, wl: Workload) -> Tuple[float, str]:
    """Seconds of one step's generation in layout ``gen``, and what bounds a decode step
    (``memory``: streaming the weights, or ``compute``)."""
    flops = hw.peak_tflops * 1e12
    rows_per_replica = wl.prompts * wl.samples / gen.dp
    gen_ranks = gen.tp * gen.pp
    prefill = 2 * counts.active * rows_per_replica * wl.prompt_tokens / (gen_ranks * flops * hw.prefill_mfu)
    weight_bytes = (counts.dense + counts.experts / max(gen.ep, 1)) * wl.bytes_per_param / gen_ranks
    decode_compute = 2 * counts.active * rows_per_replica / (gen_ranks * flops * hw.prefill_mfu)
    decode_memory = weight_bytes / (hw.hbm_tbps * 1e12 * hw.decode_hbm_efficiency)
    seconds = prefill + wl.response_tokens * max(decode_compute, decode_memory)
    return seconds, "memory" if decode_memory > decode_compute else "compute"


def training_seconds(counts: ParamCounts, gpus: int, hw: Hardware, wl: Workload, flops_per_param_token: int = 8,
                     pp: int = 1, micro_batches: Optional[int] = None) -> float:
    """Seconds of one step's training passes over every GPU (see the module docstring)."""
    tokens = wl.prompts * wl.samples * (wl.prompt_tokens + wl.response_tokens)
    flops = hw.peak_tflops * 1e12
    seconds = flops_per_param_token * counts.active * tokens / (gpus * flops * hw.train_mfu)
    if micro_batches:
        seconds *= 1 + (pp - 1) / micro_batches
    return seconds


def sync_seconds(model: ModelSpec, rg: Regrouping, hw: Hardware, wl: Workload) -> Tuple[float, float]:
    """Seconds of one weight sync and the bytes rank 0 receives (micro-DP mode)."""
    traffic = rank_traffic(model, rg, 0, "micro_dp", hw.gpus_per_node)
    recv = traffic["received"] * wl.bytes_per_param
    other = traffic["received_other_nodes"] * wl.bytes_per_param
    return (recv - other) / (hw.nvlink_gbps * 1e9) + other / (hw.ib_gbps * 1e9), recv


def predict(model: ModelSpec, topk: int, train: Layout, gen: Tuple[int, int, int], hw: Hardware, wl: Workload,
            flops_per_param_token: int = 8, micro_batches: Optional[int] = None) -> Dict[str, object]:
    """Predicted seconds of one RL step of ``model`` trained in ``train`` and generating at
    ``gen`` = (t_g, p_g, e_g), with the figures behind them."""
    counts = ParamCounts.of(model, topk)
    rg = regroup(train, *gen, model.num_experts)
    generate, bound = generation_seconds(counts, rg.gen, hw, wl)
    train_s = training_seconds(counts, train.world_size, hw, wl, flops_per_param_token, train.pp, micro_batches)
    sync, recv = sync_seconds(model, rg, hw, wl)
    return {"generate_s": generate, "train_s": train_s, "sync_s": sync, "step_s": generate + train_s + sync,
            "total_b": counts.total / 1e9, "active_b": counts.active / 1e9, "sync_gb": recv / 1e9,
            "decode_bound": bound}
