"""Model FLOPs of a decoder (dense, MoE, MLA) from its Megatron arguments, and GPU peaks: what
the run's achieved TFLOP/s and MFU are computed from.

The count follows Narayanan et al. 2021 (Megatron-LM, appendix: 96 B s l h^2 (1 + s/6h + V/16lh)
per iteration) and PaLM (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T per trained token):
2 FLOPs per multiply-accumulate of the weight matmuls (the top-k experts and the shared expert
of an MoE layer, plus its router), 4 s x (query width) per layer for attention scores and
context over a sequence of s tokens (no causal halving, as in both papers), and the output
layer; a gated delta net's convolution and recurrence are linear in s (``recurrence``). Norms, activations, softmax and recomputation are left out: these are model FLOPs, the
numerator of MFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megarl.models.hf_config import MegatronModelArgs

# Dense bf16 peak per GPU in TFLOP/s (NVIDIA data sheets, SXM parts), by a substring of
# torch.cuda.get_device_name(); first match wins.
GPU_PEAK_TFLOPS = (("A100", 312.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0))


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of a sequence of s tokens: s * (per_token + head) + s^2 * attention."""

    per_token: float
    """Weight matmuls of all decoder layers per token: 2 x the parameters one token passes through."""
    attention: float
    """Scores (q.k) and context (p.v) per token per position of its sequence, all layers."""
    lm_head: float
    """Output layer per token: 2 x hidden x vocab (tied or not)."""
    value_head: float
    """Scalar value head per token (critic, reward model): 2 x hidden."""
    recurrence: float = 0.0
    """Gated delta nets per token, all layers: their depthwise convolution (2 x its weights) and
    the delta rule on each head's [key, value] state (Sᵀk, k ⊗ δ and Sᵀq: 6 x key x value dims)."""

    def forward(self, lengths: Sequence[int], value_head: bool = False) -> float:
        """FLOPs of one forward pass over sequences of these lengths (tokens)."""
        head = self.value_head if value_head else self.lm_head
        return sum(s * (self.per_token + head + self.recurrence) + s * s * self.attention for s in lengths)


def forward_flops(args: MegatronModelArgs) -> ForwardFlops:
    kw = args.config_kwargs
    h, heads = kw["hidden_size"], kw["num_attention_heads"]
    if args.mla:  # DeepSeek-V2/V3 multi-head latent attention: low-rank q and kv projections
        qk, rope, v, kv_rank = kw["qk_head_dim"], kw["qk_pos_emb_head_dim"], kw["v_head_dim"], kw["kv_lora_rank"]
        q_rank = kw.get("q_lora_rank")
        q = h * q_rank + q_rank * heads * (qk + rope) if q_rank else h * heads * (qk + rope)
        attn_params = q + h * (kv_rank + rope) + kv_rank * heads * (qk + v) + heads * v * h
        attention = 2 * heads * (qk + rope) + 2 * heads * v
    else:
        d, groups = kw["kv_channels"], kw["num_query_groups"]
        gates = heads * d if kw.get("attention_output_gate") else 0  # gated attention's extra q_proj half
        attn_params = h * ((heads + 2 * groups) * d + gates) + heads * d * h
        attention = 4 * heads * d
    # SwiGLU (the only MLP megarl builds): gate, up and down projections.
    dense_mlp = 3 * h * kw["ffn_hidden_size"]
    experts = kw.get("num_moe_experts") or 0
    moe_mlp = (h * experts + kw.get("moe_router_topk", 0) * 3 * h * kw.get("moe_ffn_hidden_size", 0)
               + 3 * h * (kw.get("moe_shared_expert_intermediate_size") or 0)
               + (h if kw.get("moe_shared_expert_gate") else 0))
    layers = kw["num_layers"]
    moe_layers = sum(kw["moe_layer_freq"]) if experts else 0
    linear = sum(kw["linear_attention_freq"]) if kw.get("experimental_attention_variant") == "gated_delta_net" else 0
    recurrence = 0.0
    if linear:  # gated delta nets instead of attention on these layers
        nk, nv = kw["linear_num_key_heads"], kw["linear_num_value_heads"]
        dk, dv = kw["linear_key_head_dim"], kw["linear_value_head_dim"]
        delta_params = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h
        recurrence = linear * (2.0 * (2 * nk * dk + nv * dv) * kw["linear_conv_kernel_dim"] + 6.0 * nv * dk * dv)
    params = ((layers - linear) * attn_params + (linear * delta_params if linear else 0)
              + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp)
    return ForwardFlops(per_token=2.0 * params, attention=float((layers - linear) * attention),
                        lm_head=2.0 * h * args.vocab_size, value_head=2.0 * h, recurrence=recurrence)


def gpu_peak_tflops(configured: Optional[float], device_name: Optional[str]) -> Optional[float]:
    """The per-GPU peak MFU divides by: ``configured`` (logging.gpu_peak_tflops) when set, else
    the table's entry for ``device_name`` (None on CPU or for an unknown GPU)."""
    if configured is not None:
        if configured <= 0:
            raise ValueError(f"logging.gpu_peak_tflops={configured} must be > 0 (TFLOP/s), or null to "
                             f"take it from the GPU's name")
        return configured
    if device_name is None:
        return None
    return next((peak for name, peak in GPU_PEAK_TFLOPS if name in device_name), None)
