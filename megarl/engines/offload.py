"""Move a training state (parameters, gradients, optimizer state) to host memory and back.

While the rollout holds the device, the trainer's memory is freed: every storage the state
uses (Megatron DDP's contiguous param/grad buffers, parameters outside them, the optimizer's
main parameters and moments) is copied to host memory (pinned on GPUs) and resized to zero
bytes; ``reload`` restores the bytes in place, so every view (parameters are views into the
buffers) is valid again and bit-identical. On CPU the copy is a real second buffer too, so the
path is exercised (and tested) there as on GPUs, but host memory does not drop there.

Each storage belongs to one kind: ``params``, ``grads`` or ``optimizer``, the first that
references it in that order (fp32 main parameters of the optimizer that are views of the model's
own parameters are ``params``), so the kinds can be offloaded independently.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel

from megarl.engines.train_state import TrainState
from megarl.runtime.memory import pinned_host_bytes, reset_peak_memory, unpin_host, window_peaks_gb

KINDS = ("params", "grads", "optimizer")


def _tensors(state: TrainState, kind: str) -> Iterator[torch.Tensor]:
    if kind in ("params", "grads"):
        for chunk in state.model:
            # Megatron DDP's contiguous buffers; a frozen state's chunks are bare modules
            ddp = isinstance(chunk, DistributedDataParallel)
            for buffer in chunk.buffers + chunk.expert_parallel_buffers if ddp else []:
                tensor = buffer.param_data if kind == "params" else buffer.grad_data
                if tensor is not None:
                    yield tensor
            for param in chunk.parameters():
                if kind == "params":
                    yield param.data
                elif getattr(param, "main_grad", None) is not None:
                    yield param.main_grad
        return
    if state.optimizer is None:  # a frozen state (reference, reward model)
        return
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            yield from (p.data for p in group["params"])
        for values in inner.state.values():
            yield from (v for v in values.values() if torch.is_tensor(v))


def _storages_by_kind(state: TrainState) -> Dict[str, List[torch.UntypedStorage]]:
    """The state's non-empty storages, each under the first kind that references it."""
    seen = set()
    out: Dict[str, List[torch.UntypedStorage]] = {}
    for kind in KINDS:
        out[kind] = []
        for tensor in _tensors(state, kind):
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0 and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[kind].append(storage)
    return out


def _storages(state: TrainState) -> Dict[int, torch.UntypedStorage]:
    return {s.data_ptr(): s for storages in _storages_by_kind(state).values() for s in storages}


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloaded:
    """Host copies of a state's storages; ``reload()`` puts them back."""

    def __init__(self, storages: List[torch.UntypedStorage], copies: List[torch.Tensor], pinned: bool = False):
        self.storages, self.copies, self.pinned = storages, copies, pinned

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.copies)

    def reload(self) -> None:
        for storage, host in zip(self.storages, self.copies):
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self.pinned:
            for host in self.copies:
                unpin_host(host)
        self.storages, self.copies = [], []


def offload(state: TrainState, kinds: Sequence[str] = KINDS) -> Offloaded:
    """Copy the storages of ``kinds`` of ``state`` to host memory and free them on the device."""
    unknown = set(kinds) - set(KINDS)
    assert not unknown, f"offload kinds {sorted(unknown)} are not among {KINDS}"
    by_kind = _storages_by_kind(state)
    storages = [s for kind in KINDS if kind in kinds for s in by_kind[kind]]
    pin = torch.cuda.is_available()
    copies = []
    for storage in storages:
        source = _bytes(storage)
        # exact page-locked buffers: the caching host allocator would round each up to a power of two
        host = pinned_host_bytes(source.numel()) if pin else torch.empty(source.numel(), dtype=torch.uint8)
        host.copy_(source, non_blocking=pin)
        copies.append(host)
    if pin:
        torch.cuda.synchronize()
    for storage in storages:
        storage.resize_(0)
    return Offloaded(storages, copies, pinned=pin)


class PhaseOffload:
    """The trained roles' states off the device while the rollout generates (colocated placement),
    and the peak memory of each phase. The rollout calls :meth:`enter_generate` after its weight
    sync (offload) and :meth:`enter_train` when it releases the device (reload), so the
    ``generate`` window is generation and scoring with the states offloaded, and the ``train``
    window is everything else (reload, training, weight sync, offload).

    ``enter_generate`` returns the metrics of the step that ends there, each the max over ranks
    (collective over the world): ``memory/host_peak_gb/<phase>``, ``memory/gpu_peak_gb/<phase>``
    (with CUDA), and ``time/offload_s``, ``time/reload_s`` when something is offloaded."""

    def __init__(self, states: Sequence[TrainState], params: bool, grads: bool, optimizer: bool):
        self.states = list(states)
        self.kinds = tuple(k for k, on in zip(KINDS, (params, grads, optimizer)) if on)
        self.handles: List[Offloaded] = []
        self.measured: Dict[str, float] = {}  # this step's peaks and seconds so far
        self.window = None  # the phase being measured: None before the first weight sync

    def offload(self) -> float:
        """Offload the enabled kinds (no-op when none or already offloaded); returns seconds."""
        if not self.kinds or self.handles:
            return 0.0
        start = time.perf_counter()
        self.handles = [offload(state, self.kinds) for state in self.states]
        return time.perf_counter() - start

    def reload(self) -> float:
        """Put the states back (no-op when not offloaded); returns seconds."""
        if not self.handles:
            return 0.0
        start = time.perf_counter()
        for handle in self.handles:
            handle.reload()
        self.handles = []
        return time.perf_counter() - start

    def _next_window(self, phase: str) -> None:
        """Record the peaks of the window that ends here (if one was open) and open ``phase``'s."""
        if self.window is not None:
            for device, gb in window_peaks_gb().items():
                self.measured[f"memory/{device}_peak_gb/{self.window}"] = gb
        reset_peak_memory()
        self.window = phase

    def enter_train(self) -> None:
        self._next_window("train")
        seconds = self.reload()
        if self.kinds:
            self.measured["time/reload_s"] = seconds

    def enter_generate(self) -> Dict[str, float]:
        seconds = self.offload()
        if self.kinds:
            self.measured["time/offload_s"] = seconds
        self._next_window("generate")
        names = sorted(self.measured)  # the same on every rank
        values = [self.measured[n] for n in names]
        self.measured = {}
        if names:
            peaks = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
            torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
            values = peaks.tolist()
        return dict(zip(names, values))

    @contextlib.contextmanager
    def resident(self, offload_after: bool = True) -> Iterator[None]:
        """The states on the device for the duration (a checkpoint save or load, a checksum);
        offloaded again afterwards if they were and ``offload_after``. Local to this rank."""
        was_offloaded = bool(self.handles)
        self.reload()
        yield
        if was_offloaded and offload_after:
            self.offload()
