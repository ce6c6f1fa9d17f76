"""megarl: Megatron-native RL post-training for dense and MoE LLMs."""

from megarl import megatron_import as _megatron_import

__version__ = "0.1.0"

_megatron_import.install()  # a lighter import of megatron-core on CPU (see that module)
