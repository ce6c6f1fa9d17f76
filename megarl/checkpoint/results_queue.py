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

Its start has a deadline (:data:`START_DEADLINE_S`): a forked child of a process with many threads
can deadlock on a lock another thread held at the fork. Past the deadline the child is killed and
the save fails with an error that names it, instead of waiting for ever (as the stdlib's
``BaseManager.start`` would: it reads the child's address with no timeout).
"""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
from multiprocessing.managers import SyncManager

START_DEADLINE_S = 60.0  # a fork takes 0.02 s here; the child's own start, well under a second
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
        started = SyncManager(ctx=multiprocessing.get_context("fork"))
        _start(started, START_DEADLINE_S)
        manager = started
        _queue = manager.Queue()  # the proxy holds the manager, which lives as long as it
    return _queue


def _start(started: SyncManager, deadline_s: float) -> None:
    """``started.start`` with a deadline: a child that has not answered by then is killed, so the
    parent's read of its address ends (EOF) and the error names what hung."""
    def kill():
        child = getattr(started, "_process", None)  # set by start() before it waits
        if child is not None and child.is_alive():
            child.kill()

    timer = threading.Timer(deadline_s, kill)
    timer.daemon = True
    timer.start()
    failed = None
    try:
        started.start(_close_inherited_sockets)
    except (EOFError, OSError) as e:
        failed = e
    finally:
        timer.cancel()
    if failed is not None or not started._process.is_alive():  # killed as it answered: as late
        started._process.join(5.0)  # reaped (it was killed)
        raise RuntimeError(f"the dist-checkpoint writer's results queue (a multiprocessing Manager forked "
                           f"by pid {os.getpid()}) did not start within {deadline_s:g} s; it was killed. The "
                           f"save did not start: nothing was written") from failed


def install() -> None:
    """Make megatron-core's writer use :func:`write_results_queue` (idempotent)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = write_results_queue
