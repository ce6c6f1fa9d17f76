"""RMSNorm for local (non-TE) layer specs that works with sequence parallelism.

Megatron's ``WrappedTorchNorm`` refuses sequence parallelism because it does not tag its weight;
this one tags ``weight.sequence_parallel`` so Megatron's ``finalize_model_grads`` sums the
weight's gradient over the tensor-parallel group, as Transformer Engine's norm does. It computes
in fp32 and casts back, as Hugging Face's Llama/Qwen RMSNorm does. With a zero-centred gamma
(``layernorm_zero_centered_gamma``: Qwen3-Next, Qwen3.5) the scale is ``1 + w``, applied in fp32
before the cast, as transformers' Qwen3NextRMSNorm does.
"""

from __future__ import annotations

import torch

from megarl.runtime.devices import param_device


class RMSNorm(torch.nn.Module):
    """``y = w * (x / sqrt(mean(x^2) + eps))`` over the last dimension (``1 + w`` zero-centred)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        if normalization != "RMSNorm" or config.normalization != "RMSNorm":
            raise ValueError(f"megarl's local norm implements RMSNorm only, not {config.normalization}")
        self.zero_centered = bool(zero_centered_gamma or config.layernorm_zero_centered_gamma)
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=param_device(config)))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)
