"""megarl: Megatron-native RL post-training for dense and MoE LLMs."""

__version__ = "0.1.0"
