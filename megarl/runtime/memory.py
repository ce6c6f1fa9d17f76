"""Peak memory of this process, in GB: host resident set size and, with CUDA, device memory
allocated and reserved by torch and used on the whole device (every process: the rollout
engines' too); over the whole run, or per phase (``PhasePeaks``). And the allocator setting
megarl's workers start with (:func:`allocator_env`)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Dict, Mapping

import torch

# the highest peaks a per-phase reset has discarded, so that the run's peaks stay right
_reset_high_water_kb = 0
_reset_gpu_peak_bytes = 0
_reset_reserved_peak_bytes = 0

# torch reads the first of these that is set (PYTORCH_ALLOC_CONF, the accelerator-agnostic name, wins)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """The allocator variable a worker starts with: ``expandable_segments:True`` (segments that
    grow in place, so that memory freed by an offload is not left fragmented in fixed blocks)
    added to the user's own setting, in the variable the user set; nothing when the user chose
    ``expandable_segments`` either way."""
    for name in ALLOC_CONF_VARS:
        conf = environ.get(name, "")
        if conf:
            return {} if "expandable_segments" in conf else {name: f"{conf},expandable_segments:True"}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


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


def pinned_host_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory, exactly: a host tensor registered with
    ``cudaHostRegister`` (torch's caching host allocator, behind ``pin_memory=True``, rounds each
    block up to a power of two: 17.6 GB would pin 32 GB). Release it with :func:`unpin_host`."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {err})")
    return host


def unpin_host(host: torch.Tensor) -> None:
    """Unregister a :func:`pinned_host_bytes` buffer (before it is freed)."""
    if host.numel():
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def peak_gpu_reserved_gb() -> float:
    """torch's peak CUDA memory reserved by this process's caching allocator (allocated, plus
    freed blocks it keeps), per-phase resets included."""
    return max(torch.cuda.max_memory_reserved(), _reset_reserved_peak_bytes) / 2**30


def device_used_gb() -> float:
    """Memory used on this process's GPU now, by every process (total - free from
    ``cudaMemGetInfo``): the rollout engines' processes included, which torch's figures omit."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def reset_peak_memory() -> None:
    """Start a new measuring window: the host high-water mark (VmHWM) drops to the current RSS
    (Linux: ``echo 5 > /proc/self/clear_refs``), and torch's CUDA peak to the current allocation."""
    global _reset_high_water_kb, _reset_gpu_peak_bytes, _reset_reserved_peak_bytes
    _reset_high_water_kb = max(_reset_high_water_kb, _status_kb("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")
    if torch.cuda.is_available():
        _reset_gpu_peak_bytes = max(_reset_gpu_peak_bytes, torch.cuda.max_memory_allocated())
        _reset_reserved_peak_bytes = max(_reset_reserved_peak_bytes, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()


def window_peaks_gb() -> Dict[str, float]:
    """Peak host RSS (and GPU memory, allocated and reserved) since the last :func:`reset_peak_memory`."""
    peaks = {"host": _status_kb("VmHWM") / 2**20}
    if torch.cuda.is_available():
        peaks["gpu"] = torch.cuda.max_memory_allocated() / 2**30
        peaks["gpu_reserved"] = torch.cuda.max_memory_reserved() / 2**30
    return peaks
