"""Where tensors live: the one place that moves a batch onto this rank's device and results
back to the host.

The driver may have no GPU, and Ray ships whatever a worker returns: a worker's inputs go to
its device in :func:`to_device` (on arrival), and everything it returns comes back through
:func:`to_host`. On CPU (gloo and CPU mode) both are no-ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


def compute_device() -> torch.device:
    """This rank's CUDA device, or the CPU on a machine without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_device(config) -> torch.device:
    """Where a module of ours allocates its parameters: as Megatron's own modules do, on the
    current CUDA device unless ``config.use_cpu_initialization``."""
    return torch.device("cpu") if config.use_cpu_initialization else compute_device()


def to_device(tree: Any, device: torch.device | None = None) -> Any:
    """``tree`` (tensors in dicts, lists, tuples) with every tensor on ``device`` (default: this rank's)."""
    device = device or compute_device()
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)


def to_host(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (what a worker returns to the driver)."""
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def group_device(group=None) -> torch.device:
    """The device a process group's backend takes tensors on: this rank's CUDA device for NCCL
    (NCCL refuses CPU tensors), the CPU for gloo. ``group`` None is the default group."""
    import torch.distributed as dist

    return compute_device() if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu")


def synchronize() -> None:
    """Wait for this rank's queued device work (before a timer stops: CUDA kernels run asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
