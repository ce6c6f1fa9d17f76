"""A device memory model for the GPU-shaped harness (megarl.testing.gpu_shaped): what a GPU's
memory would hold, so that tests see an engine started over a resident trainer, or a buffer kept
past its phase, as a GPU run at real sizes would (refused, or out of memory).

What it counts, per process (one process is one GPU, as under torchrun or Ray):

* **live CUDA-shaped storage**: every distinct untyped storage of a CUDA-shaped tensor, by its
  current size (``UntypedStorage.resize_`` is followed: an offloaded state's storages count 0),
  until the storage dies (a weak reference's callback); what ``torch.cuda.memory_allocated``
  reports under the harness;
* **the caching allocator's reserve**: the high-water mark of live storage since the last
  ``torch.cuda.empty_cache`` (freed blocks stay reserved until then, as torch's allocator keeps
  them); ``memory_reserved``;
* **what a rollout engine reserves when it starts**, in its own processes on this GPU: vLLM asks
  ``gpu_memory_utilization`` × total and refuses to start when less is free (vllm 0.32,
  ``v1/worker/utils.py: request_memory``); SGLang takes what is free beyond
  (1 − ``mem_fraction_static``) × total, so over an empty device ``mem_fraction_static`` × total,
  and refuses when nothing is left (sglang 0.5.6, ``ModelRunner.profile_max_num_token``). A
  released engine (vLLM's sleep, SGLang's memory saver) holds nothing until it resumes its pool;
* **pinned host memory**: ``pin_memory=True`` allocations rounded up to a power of two, as torch's
  caching host allocator does (``CachingHostAllocator.h``), and ``cudaHostRegister`` ranges exactly.

The budget is ``MEGARL_GPU_SHAPED_MEMORY_GB`` (default 80, an H100's): an allocation beyond it
raises torch's ``OutOfMemoryError``; ``torch.cuda.mem_get_info`` reports the budget less the
reserve and the engines' pools, so megarl's own memory metrics read the model.

Phases are megarl's own: each :func:`megarl.runtime.progress.phase` (a worker's verb:
``rollout.update_weights``, ``actor.update_actor``, ...) is a memory phase too, and :func:`report`
gives each phase's peak (this process's live storage, and the device's: with the engines' pools)
and its live bytes at start and end. Engine starts are recorded with the live bytes of this
process at that moment (:func:`engine_starts`).

Engines are charged to the process that starts them (a t_g > 1 engine spans its TP ranks' GPUs;
the model charges the rank that builds it). Only tests use this module.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

ENV = "MEGARL_GPU_SHAPED_MEMORY_GB"
DEFAULT_GB = 80.0
GiB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


@dataclass
class Engine:
    """A rollout engine's memory on this GPU: its pool, held unless released."""

    kind: str
    pool: int
    held: bool = True


@dataclass
class Phase:
    """One occurrence of a phase: live bytes at its start and end, and its peaks."""

    name: str
    live_start: int
    peak: int  # this process's live CUDA storage
    device_peak: int  # the device's: live storage plus the engines' held pools
    live_end: Optional[int] = None


@dataclass
class DeviceMemory:
    """The model's state for this process (see the module docstring)."""

    total: int
    storages: Dict[int, list] = field(default_factory=dict)  # storage key -> [weakref, bytes]
    live: int = 0
    peak: int = 0  # since the last reset_peak_memory_stats
    reserved: int = 0
    peak_reserved: int = 0
    engines: List[Engine] = field(default_factory=list)
    starts: List[dict] = field(default_factory=list)
    open: List[Phase] = field(default_factory=list)
    history: List[Phase] = field(default_factory=list)
    pinned: Dict[int, list] = field(default_factory=dict)  # caching host allocator blocks: key -> [ref, bytes]
    registered: Dict[int, int] = field(default_factory=dict)  # cudaHostRegister: pointer -> bytes

    # ------------------------------------------------------------------ device storage
    def engines_held(self) -> int:
        return sum(e.pool for e in self.engines if e.held)

    def free(self) -> int:
        """What ``cudaMemGetInfo`` would say is free: the budget less the reserve and the engines."""
        return max(0, self.total - self.reserved - self.engines_held())

    def _grew(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.reserved = max(self.reserved, self.live)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        device = self.live + self.engines_held()
        for phase in self.open:
            phase.peak = max(phase.peak, self.live)
            phase.device_peak = max(phase.device_peak, device)
        if device > self.total:
            # torch's allocator frees its cached blocks and retries before it gives up
            self.reserved = self.live
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {_gib(nbytes)} GiB. GPU 0 has a total capacity of "
                f"{_gib(self.total)} GiB (GPU-shaped memory model, {ENV}): this process holds {_gib(self.live)} GiB "
                f"of live tensors, rollout engines {_gib(self.engines_held())} GiB")

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once per storage)."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key in self.storages:
            return
        nbytes = storage.nbytes()
        self.storages[key] = [weakref.ref(storage, lambda _, k=key: self._died(k)), nbytes]
        if nbytes:
            self._grew(nbytes)

    def _died(self, key: int) -> None:
        entry = self.storages.pop(key, None)
        if entry is not None:
            self.live -= entry[1]

    def resized(self, storage, nbytes: int) -> None:
        """A tracked storage's new size (offload frees by ``resize_(0)``, reload grows it back)."""
        entry = self.storages.get(storage._cdata)
        if entry is None:
            return
        old, entry[1] = entry[1], nbytes
        if nbytes > old:
            self._grew(nbytes - old)
        else:
            self.live -= old - nbytes

    def refresh(self) -> int:
        """Live bytes recounted from the storages' sizes (a tensor's own ``resize_`` is not followed)."""
        live = 0
        for entry in list(self.storages.values()):
            storage = entry[0]()
            if storage is not None:
                entry[1] = storage.nbytes()
                live += entry[1]
        if live > self.live:
            self._grew(live - self.live)
        self.live = live
        return live

    # ------------------------------------------------------------------ engines
    def start_engine(self, kind: str, fraction: float) -> Engine:
        """A rollout engine of ``kind`` ("vllm" or "sglang") starting on this GPU with its memory
        fraction; refused as the engine refuses."""
        self.refresh()
        free, total = self.free(), self.total
        if kind == "vllm":
            pool = math.ceil(total * fraction)
            if free < pool:
                raise ValueError(f"Free memory on device cuda:0 ({_gib(free)}/{_gib(total)} GiB) on startup is less "
                                 f"than desired GPU memory utilization ({fraction}, {_gib(pool)} GiB). Decrease GPU "
                                 f"memory utilization or reduce GPU memory used by other processes.")
        elif kind == "sglang":
            pool = int(free - (1 - fraction) * total)
            if pool <= 0:
                raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
        else:
            raise ValueError(f"unknown engine kind {kind!r}: 'vllm' or 'sglang'")
        engine = Engine(kind, pool)
        self.engines.append(engine)
        self.starts.append({"engine": kind, "pool": pool, "process_live": self.live, "free": free,
                            "phase": self.open[-1].name if self.open else None})
        self._grew(0)  # the phases see the pool
        return engine

    def release_engine(self, engine: Engine) -> None:
        engine.held = False

    def resume_engine(self, engine: Engine) -> None:
        """The engine takes its pool back (vLLM's wake-up, SGLang's resume): out of memory when the
        device cannot hold it beside this process's tensors."""
        if engine.held:
            return
        engine.held = True
        self._grew(0)

    def stop_engine(self, engine: Engine) -> None:
        if engine in self.engines:
            self.engines.remove(engine)

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str):
        live = self.refresh()
        record = Phase(name, live, live, live + self.engines_held())
        self.open.append(record)
        try:
            yield
        finally:
            record.live_end = self.refresh()
            self.open.remove(record)
            self.history.append(record)

    # ------------------------------------------------------------------ pinned host memory
    def pinned_by_caching_allocator(self, out):
        """``out`` (made with ``pin_memory=True``) counted as torch's caching host allocator gives
        it: its size rounded up to a power of two."""
        if isinstance(out, torch.Tensor):
            storage = out.untyped_storage()
            key = storage._cdata
            if key not in self.pinned:
                rounded = 1 << max(0, storage.nbytes() - 1).bit_length() if storage.nbytes() else 0
                self.pinned[key] = [weakref.ref(storage, lambda _, k=key: self.pinned.pop(k, None)), rounded]
        return out

    def pinned_bytes(self) -> int:
        """Host memory page-locked now: caching-allocator blocks (rounded) and registered ranges (exact)."""
        return sum(e[1] for e in self.pinned.values()) + sum(self.registered.values())


_model: Optional[DeviceMemory] = None


def model() -> Optional[DeviceMemory]:
    """This process's model (None before :func:`enable`)."""
    return _model


def budget_bytes() -> int:
    return int(float(os.environ.get(ENV, DEFAULT_GB)) * GiB)


class _CudaRuntime:
    """``torch.cuda.cudart()`` under the harness: page-locking recorded, not done."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        _model.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0 if _model.registered.pop(ptr, None) is not None else 1  # cudaErrorInvalidValue

    def cudaProfilerStart(self) -> int:  # noqa: N802
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802
        return 0


def enable() -> DeviceMemory:
    """Install the model for this process (idempotent): torch.cuda's memory queries read it,
    storage resizes and megarl's phases reach it."""
    global _model
    if _model is not None:
        return _model
    _model = m = DeviceMemory(budget_bytes())
    cuda = torch.cuda
    cuda.memory_allocated = lambda *a, **k: m.live
    cuda.max_memory_allocated = lambda *a, **k: m.peak
    cuda.memory_reserved = lambda *a, **k: m.reserved
    cuda.max_memory_reserved = lambda *a, **k: m.peak_reserved

    def reset_peak_memory_stats(*args, **kwargs):
        m.peak, m.peak_reserved = m.live, m.reserved

    def empty_cache():
        m.reserved = m.live

    def mem_get_info(*args, **kwargs):
        m.refresh()
        return m.free(), m.total

    cuda.reset_peak_memory_stats = reset_peak_memory_stats
    cuda.empty_cache = empty_cache
    cuda.mem_get_info = mem_get_info
    cuda.cudart = lambda: _CudaRuntime()

    resize = torch.UntypedStorage.resize_

    def resize_(self, nbytes):
        out = resize(self, nbytes)
        m.resized(self, int(nbytes))
        return out

    torch.UntypedStorage.resize_ = resize_

    from megarl.runtime import progress

    phase = progress.phase

    @contextlib.contextmanager
    def phase_(name: str):
        with phase(name), m.phase(name):
            yield

    progress.phase = phase_
    return m


def track(tensor: torch.Tensor) -> None:
    """Called by the harness for each tensor it marks CUDA-shaped."""
    if _model is not None:
        _model.track(tensor)


def pinned(out):
    """Called by the harness for what a ``pin_memory=True`` call made."""
    return out if _model is None else _model.pinned_by_caching_allocator(out)


def start_engine(kind: str, fraction: float) -> Optional[Engine]:
    """For an engine stand-in's constructor: the engine's pool reserved (refused as it refuses)."""
    return None if _model is None else _model.start_engine(kind, fraction)


def report() -> Dict[str, Dict[str, float]]:
    """Each phase's peaks in GiB over its occurrences: ``{"allocated": ..., "device": ...}``."""
    out: Dict[str, Dict[str, float]] = {}
    for p in (_model.history if _model is not None else []):
        entry = out.setdefault(p.name, {"allocated": 0.0, "device": 0.0})
        entry["allocated"] = max(entry["allocated"], p.peak / GiB)
        entry["device"] = max(entry["device"], p.device_peak / GiB)
    return out


def engine_starts() -> List[dict]:
    return [] if _model is None else list(_model.starts)
