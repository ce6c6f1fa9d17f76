"""Peak memory of this process, in GB: host resident set size and, with CUDA, device memory
allocated by torch."""

from __future__ import annotations

import resource

import torch


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def peak_gpu_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30
