"""Process start-up: torch.distributed and the CPU mode for megatron-core; peak memory.

The names below load on first use: the run's watchdog (``python -m megarl.runtime.processes``)
and the processes it and the signal handling import stay torch-free, so a watchdog is up in tens
of milliseconds, not the seconds an import of torch takes on a loaded node (a Ctrl-C in a run's
first seconds must find it listening).
"""

import importlib

_WHERE = {"init_distributed": "distributed", "set_seed": "distributed", "shutdown": "distributed",
          "torn_down": "distributed", "world_size_from_env": "distributed", "peak_gpu_gb": "memory",
          "peak_rss_gb": "memory", "reset_peak_memory": "memory", "window_peaks_gb": "memory"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"megarl.runtime.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'megarl.runtime' has no attribute '{name}'")
