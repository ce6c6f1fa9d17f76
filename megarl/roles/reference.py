"""The reference policy: frozen, forward-only log-probs for the KL term."""

from __future__ import annotations

import contextlib

import torch

from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.models import lora
from megarl.protocol import Dispatch, verb


class Reference:
    """A frozen copy of the initial policy in its own layout, or (``adapters_off``) a LoRA actor's
    own engine run with its adapters off: the frozen base is the initial policy, no second copy."""

    def __init__(self, engine: MegatronEngine, temperature: float = 1.0, adapters_off: bool = False):
        if adapters_off and not lora.has_lora(engine.state.model):
            raise ValueError("adapters_off needs an engine whose model has LoRA adapters (megarl.models.lora)")
        if not adapters_off and engine.state.optimizer is not None:
            raise ValueError("the reference's engine must be frozen (megarl.engines.train_state.build_frozen_state)")
        self.engine = engine
        self.temperature = temperature
        self.adapters_off = adapters_off

    @verb(Dispatch.DP, output="ref_log_probs")
    def compute_log_prob(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        base = lora.adapters_off(self.engine.state.model) if self.adapters_off else contextlib.nullcontext()
        with base:
            return self.engine.forward_log_probs(batch, lengths, how, self.temperature)["log_probs"]
