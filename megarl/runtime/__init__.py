"""Process start-up: torch.distributed and the CPU mode for megatron-core; peak memory."""

from megarl.runtime.distributed import init_distributed, set_seed, shutdown, torn_down, world_size_from_env
from megarl.runtime.memory import peak_gpu_gb, peak_rss_gb, reset_peak_memory, window_peaks_gb

__all__ = ["init_distributed", "peak_gpu_gb", "peak_rss_gb", "reset_peak_memory", "set_seed", "shutdown", "torn_down",
           "window_peaks_gb", "world_size_from_env"]
