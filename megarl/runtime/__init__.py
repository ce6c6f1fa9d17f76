"""Process start-up: torch.distributed and the CPU mode for megatron-core."""

from megarl.runtime.distributed import init_distributed, set_seed, shutdown, world_size_from_env

__all__ = ["init_distributed", "set_seed", "shutdown", "world_size_from_env"]
