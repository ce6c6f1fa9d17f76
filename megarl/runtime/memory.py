"""Peak memory of this process, in GB: host resident set size and, with CUDA, device memory
allocated by torch; over the whole run, or per phase (``PhasePeaks``)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Dict

import torch

# the highest peaks a per-phase reset has discarded, so that the run's peaks stay right
_reset_high_water_kb = 0
_reset_gpu_peak_bytes = 0


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def peak_rss_gb() -> float:
    """The host RSS high-water mark of this process so far, per-phase resets included."""
    # ru_maxrss (KiB on Linux) follows the kernel's high-water mark, which a phase reset lowers
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _reset_high_water_kb) / 2**20


def peak_gpu_gb() -> float:
    """torch's peak CUDA allocation of this process so far, per-phase resets included."""
    return max(torch.cuda.max_memory_allocated(), _reset_gpu_peak_bytes) / 2**30


def reset_peak_memory() -> None:
    """Start a new measuring window: the host high-water mark (VmHWM) drops to the current RSS
    (Linux: ``echo 5 > /proc/self/clear_refs``), and torch's CUDA peak to the current allocation."""
    global _reset_high_water_kb, _reset_gpu_peak_bytes
    _reset_high_water_kb = max(_reset_high_water_kb, _status_kb("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")
    if torch.cuda.is_available():
        _reset_gpu_peak_bytes = max(_reset_gpu_peak_bytes, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()


def window_peaks_gb() -> Dict[str, float]:
    """Peak host RSS (and GPU memory) since the last :func:`reset_peak_memory`."""
    peaks = {"host": _status_kb("VmHWM") / 2**20}
    if torch.cuda.is_available():
        peaks["gpu"] = torch.cuda.max_memory_allocated() / 2**30
    return peaks
