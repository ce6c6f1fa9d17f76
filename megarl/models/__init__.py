"""Megatron GPT models (dense and MoE) built from Hugging Face configs."""

from megarl.models.builder import build_model, transformer_config
from megarl.models.hf_config import (
    ARCHITECTURES, MegatronModelArgs, UnsupportedModelError, megatron_args_from_hf, padded_vocab_size,
)

__all__ = ["ARCHITECTURES", "MegatronModelArgs", "UnsupportedModelError", "build_model",
           "megatron_args_from_hf", "padded_vocab_size", "transformer_config"]
