"""NCCL's point-to-point pairing for the GPU-shaped harness (megarl.testing.gpu_shaped).

NCCL ignores tags: between two ranks of a communicator, the k-th receive one posts from the other
gets the k-th message the other posted to it. Gloo matches by tag, so code whose two sides post in
different orders (relying on tags) passes on CPU and, on GPUs, delivers a message into the wrong
buffer: silently wrong values, a truncation or a hang. On NCCL-shaped groups the harness sends
every point-to-point message on two fixed gloo channels per pair of ranks, whatever its tag:

* a descriptor (the sender's dtype, shape, element count, tag and count of messages so far),
  which is small and of fixed size, so it always pairs in posting order;
* the payload, whose receive is posted once its descriptor has arrived and agrees.

A receive whose descriptor disagrees (another dtype, element count or tag) raises
:class:`PairingMismatch` naming both sides; its payload is drained so that the sender is not left
waiting. A tag disagreement alone is refused too: of the same-sized messages swapped on NCCL and a
hang on gloo, such code has one on each backend. Receives from one peer are posted in order by one thread per peer, so posting never waits
for anything NCCL would not wait for (a receive posted before a send to the same peer in one batch
completes as on NCCL).
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from typing import Callable, Dict, Optional

import torch

_DESC_TAG, _DATA_TAG = 0x4E4301, 0x4E4302  # the two gloo channels of every pair of ranks
_DIMS = 8  # shape dimensions a descriptor carries (more: the element count alone)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
_CODES = {d: i for i, d in enumerate(_DTYPES)}


class PairingMismatch(RuntimeError):
    """A receive paired (in posting order, as NCCL pairs) with a send it does not agree with."""


def _describe(tensor: torch.Tensor, tag: int, seq: int) -> torch.Tensor:
    """[seq, tag, dtype code, numel, nbytes, ndim, shape (up to _DIMS)] as int64."""
    shape = list(tensor.shape)
    dims = shape if len(shape) <= _DIMS else []
    head = [seq, tag, _CODES.get(tensor.dtype, -1), tensor.numel(), tensor.numel() * tensor.element_size(),
            len(shape)]
    return torch.tensor(head + dims + [0] * (_DIMS - len(dims)), dtype=torch.int64)


def _what(code: int, numel: int, ndim: int, dims, tag: int) -> str:
    dtype = str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "?"
    shape = list(dims[:ndim]) if ndim <= _DIMS else f"{ndim}-dim"
    return f"tag {tag}, {dtype} {shape}, {numel} elements"


class _Sent:
    """The work of one paired send: its descriptor and its payload."""

    def __init__(self, works, keep):
        self._works, self._keep = works, keep

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed()


class _Received:
    """The work of one paired receive: done once its payload is in the caller's tensor."""

    def __init__(self, pairing: "Pairing", peer: int, tensor: torch.Tensor, tag: int, seq: int):
        self.pairing, self.peer, self.tensor, self.tag, self.seq = pairing, peer, tensor, tag, seq
        self.desc = torch.empty(6 + _DIMS, dtype=torch.int64)
        self.desc_work = None
        self.data_work = None
        self.error: Optional[BaseException] = None
        self.posted = threading.Event()

    def wait(self, timeout=None) -> bool:
        seconds = self.pairing.timeout.total_seconds() if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        if not self.posted.wait(seconds):
            raise TimeoutError(f"{self.pairing.name}: rank {self.pairing.me}'s receive #{self.seq} from rank "
                               f"{self.pairing.rank_name(self.peer)} (tag {self.tag}) got no message within "
                               f"{seconds:.0f} s")
        if self.error is not None:
            raise self.error
        self.data_work.wait()
        return True

    def is_completed(self) -> bool:
        return self.posted.is_set() and (self.error is not None or self.data_work.is_completed())

    def is_success(self) -> bool:
        return self.is_completed() and self.error is None


class Pairing:
    """The point-to-point messages of one NCCL-shaped group, carried by its gloo process group ``pg``
    (``send``/``recv`` on group ranks). ``rank_name(group_rank)`` names a rank in errors."""

    def __init__(self, pg, name: str, timeout: datetime.timedelta,
                 rank_name: Callable[[int], str] = str):
        # the group is held weakly: its owner (c10d's registry, or the stand-in that built it)
        # decides its lifetime; a pairing is kept by the group (gpu_shaped's weak-keyed table)
        self._pg = weakref.ref(pg)
        self.name, self.timeout, self.rank_name = name, timeout, rank_name
        self.me = rank_name(pg.rank())
        self._lock = threading.Lock()
        self._sent: Dict[int, int] = {}
        self._received: Dict[int, int] = {}
        self._queues: Dict[int, "queue.Queue[_Received]"] = {}
        # the serving threads hold this pairing weakly and stop with it: held strongly, a group
        # built directly (the ProcessGroupNCCL stand-in's gloo group) outlived its owner to
        # interpreter exit, and gloo's threads, destroyed after Python finalized, aborted the
        # process (``terminate called without an active exception``, exit -6, 6 runs in 30)
        weakref.finalize(self, _stop_serving, self._queues)

    @property
    def pg(self):
        pg = self._pg()
        if pg is None:
            raise RuntimeError(f"{self.name}: the process group was destroyed; a point-to-point message after "
                               f"destroy_process_group has no group to go on")
        return pg

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> _Sent:
        with self._lock:  # descriptor and payload back to back: the channels stay in step
            seq = self._sent[peer] = self._sent.get(peer, 0) + 1
            desc = _describe(tensor, tag, seq)
            works = [self.pg.send([desc], peer, _DESC_TAG), self.pg.send([tensor], peer, _DATA_TAG)]
        return _Sent(works, (desc, tensor))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> _Received:
        with self._lock:
            seq = self._received[peer] = self._received.get(peer, 0) + 1
            entry = _Received(self, peer, tensor, tag, seq)
            entry.desc_work = self.pg.recv([entry.desc], peer, _DESC_TAG)  # fixed size: always pairs
            if peer not in self._queues:
                self._queues[peer] = queue.Queue()
                threading.Thread(target=_serve, args=(weakref.ref(self), peer, self._queues[peer]), daemon=True,
                                 name=f"nccl-pairing-{peer}").start()
            self._queues[peer].put(entry)
        return entry


def _stop_serving(queues: Dict[int, "queue.Queue[Optional[_Received]]"]) -> None:
    for entries in list(queues.values()):
        entries.put(None)


def _serve(pairing_ref: "weakref.ref[Pairing]", peer: int, entries: "queue.Queue[Optional[_Received]]") -> None:
    """Post the payload receives from ``peer`` in order, each once its descriptor agrees; return
    once the pairing is gone (nothing here keeps it, or its group, alive between receives)."""
    while True:
        entry = entries.get()
        self = pairing_ref() if entry is not None else None
        if self is None:
            return
        try:
            entry.desc_work.wait()
            seq, tag, code, numel, nbytes, ndim, *dims = entry.desc.tolist()
            mine = entry.tensor
            if (code, numel, tag) != (_CODES.get(mine.dtype, -2), mine.numel(), entry.tag):
                scratch = torch.empty(nbytes, dtype=torch.uint8)  # drained: the sender completes
                self.pg.recv([scratch], peer, _DATA_TAG).wait()
                ours = _what(_CODES.get(mine.dtype, -1), mine.numel(), mine.dim(), list(mine.shape), entry.tag)
                entry.error = PairingMismatch(
                    f"{self.name}: NCCL pairs point-to-point messages between two ranks in posting order and "
                    f"ignores tags: rank {self.me}'s receive #{entry.seq} from rank {self.rank_name(peer)} "
                    f"({ours}) is paired with rank {self.rank_name(peer)}'s send #{seq} to rank {self.me} "
                    f"({_what(code, numel, ndim, dims, tag)}); on GPUs it would get that message (wrong "
                    f"values, a truncation or a hang). Post the sends and receives between two ranks in the "
                    f"same order on both sides.")
            else:
                entry.data_work = self.pg.recv([mine], peer, _DATA_TAG)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the receive
            entry.error = e
        entry.posted.set()
        # the thread lets go of the receive and the pairing while it waits for the next: kept, the
        # caller's buffer would outlive its phase in the device memory model (NCCL holds none)
        entry = mine = self = None
