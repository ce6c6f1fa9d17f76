"""Move a training state (parameters, gradients, optimizer state) to host memory and back.

While the rollout holds the device, the trainer's memory is freed: every storage the state
uses (Megatron DDP's contiguous param/grad buffers, parameters outside them, the optimizer's
main parameters and moments) is copied to host memory (pinned on GPUs) and resized to zero
bytes; ``reload`` restores the bytes in place, so every view (parameters are views into the
buffers) is valid again and bit-identical. On CPU the copy is a real second buffer too, so the
path is exercised (and tested) there as on GPUs.
"""

from __future__ import annotations

from typing import Dict, Iterator, List

import torch

from megarl.training.lm import TrainState


def _tensors(state: TrainState) -> Iterator[torch.Tensor]:
    for chunk in state.model:
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            for tensor in (buffer.param_data, buffer.grad_data):
                if tensor is not None:
                    yield tensor
        for param in chunk.parameters():
            yield param.data
            if getattr(param, "main_grad", None) is not None:
                yield param.main_grad
    optimizers = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    for opt in optimizers:
        inner = opt.optimizer
        for group in inner.param_groups:
            yield from (p.data for p in group["params"])
        for values in inner.state.values():
            yield from (v for v in values.values() if torch.is_tensor(v))


def _storages(state: TrainState) -> Dict[int, torch.UntypedStorage]:
    unique: Dict[int, torch.UntypedStorage] = {}
    for tensor in _tensors(state):
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            unique.setdefault(storage.data_ptr(), storage)
    return unique


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloaded:
    """Host copies of a state's storages; ``reload()`` puts them back."""

    def __init__(self, storages: List[torch.UntypedStorage], copies: List[torch.Tensor]):
        self.storages, self.copies = storages, copies

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.copies)

    def reload(self) -> None:
        for storage, host in zip(self.storages, self.copies):
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.storages, self.copies = [], []


def offload(state: TrainState) -> Offloaded:
    """Copy every storage of ``state`` to host memory and free it on the device."""
    storages = list(_storages(state).values())
    pin = torch.cuda.is_available()
    copies = []
    for storage in storages:
        source = _bytes(storage)
        host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=pin)
        host.copy_(source, non_blocking=pin)
        copies.append(host)
    if pin:
        torch.cuda.synchronize()
    for storage in storages:
        storage.resize_(0)
    return Offloaded(storages, copies)
