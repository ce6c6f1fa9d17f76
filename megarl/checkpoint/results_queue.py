"""The queue through which megatron-core's dist-checkpoint writer reports its writes, started by
fork instead of spawn.

megatron-core's ``FileSystemWriterAsync`` (the ``torch_dist`` format's writer) returns its write
results through a ``multiprocessing`` Manager queue, which it starts once per process, on that
process's first save, with the *spawn* start method
(``megatron/core/dist_checkpointing/strategies/filesystem_async.py``,
``_get_write_results_queue``). A spawned process imports the parent's main module again: a
torchrun worker's script (torch, megatron-core, megarl) or a Ray worker's (Ray). Measured here,
with a main module that imports torch and megatron-core: 3.6 s before the first save starts and
4.7 s of CPU, on every rank that saves. A Manager started by fork is ready in 0.02 s.

megatron-core needs spawn only for its persistent async caller (``PersistentAsyncCaller``), which
gets the queue by pickling. megarl saves in the calling process, or in the background through
``AsyncCallsQueue(persistent=False)``, whose writer is a forked process that inherits the queue.

A forked process inherits every open descriptor of its parent. The Manager lives as long as its
parent, so it replaces the sockets it inherited with /dev/null before it serves: Ray's connections, gloo's pairs,
torch's rendezvous store. Otherwise, after its parent died, it would keep those connections open,
and the peers that wait for them to close would not learn of the death. It also dies with its
parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import multiprocessing
import os
import stat
from multiprocessing.managers import SyncManager

_queue = None
manager = None  # this process's SyncManager, once started


def _close_inherited_sockets() -> None:
    """In the forked Manager, before it opens its own listener: close every inherited socket,
    and die with the parent."""
    from megarl.runtime.processes import die_with_parent

    die_with_parent()
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                # /dev/null in its place, not a close: the number stays taken, so an inherited
                # object that closes it later cannot close a socket of the Manager's own
                os.dup2(null, fd)
        except OSError:  # the directory's own descriptor, already closed
            continue
    os.close(null)


def write_results_queue():
    """This process's queue for the writer's results (a Manager queue proxy, as megatron-core's)."""
    global _queue, manager
    if _queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(_close_inherited_sockets)
        _queue = manager.Queue()  # the proxy holds the manager, which lives as long as it
    return _queue


def install() -> None:
    """Make megatron-core's writer use :func:`write_results_queue` (idempotent)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = write_results_queue
