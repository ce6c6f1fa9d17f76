"""A scalar value head in place of a GPTModel's output layer (the critic, a reward model).

It takes the output layer's slot, so Megatron's GPTModel returns values [b, s, 1] instead of
logits. The weight is replicated over tensor-parallel ranks: with sequence parallelism the
hidden states are gathered along the sequence with a *split* backward (not reduce-scatter),
since every tensor-parallel rank computes the same values and the same loss.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from megarl.runtime.devices import param_device


class ValueHead(MegatronModule):
    """values = hidden @ weight.T + bias, one scalar per token. The parameters keep the output
    layer's names (Megatron's GPTModel checkpoints ``output_layer.weight`` by that key)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.sequence_parallel = config.sequence_parallel
        device = param_device(config)
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))
        config.init_method(self.weight.data)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_head(chunks) -> None:
    """Replace the output layer of the last pipeline stage's chunk with a :class:`ValueHead`."""
    for chunk in chunks:
        if getattr(chunk, "post_process", False):
            chunk.output_layer = ValueHead(chunk.config)
