"""The driver's view of every rank's progress (``trainer.hang_timeout_s``; the mechanism is
described in :mod:`megarl.runtime.progress`).

:class:`Monitor` is a small Ray actor (no CPU slot) that keeps each rank's latest heartbeat;
:class:`Liveness` is the driver's side: a thread of its own reads the monitor once per heartbeat
period, and while :func:`megarl.controller.group.wait_groups` waits on ranks it names, from the
latest snapshot, the first rank that has made no progress for ``hang_timeout_s``.

The driver's main thread makes no Ray call for the hang check. It must stay where Ctrl-C reaches
it: Python runs a signal handler on the main thread only, between bytecodes, so a main thread inside
a native call that does not return never raises KeyboardInterrupt. Ray's waits (``ray.wait``,
``ray.get``) look for signals while they wait; a submission (``actor.method.remote()``) does not,
and a driver was once found 20 s after Ctrl-C still inside the monitor's ``submit_actor_task``,
called from the wait's poll. Here a stuck poll stops only the hang check (no snapshot is fresh, so
no rank is named); the wait, and Ctrl-C, go on.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from megarl.runtime import progress

Key = Tuple[str, int]  # (group name, rank)
# The monitor answers in milliseconds; on a node loaded far past its cores (a load average of 60
# on 2 cores was seen) it can take longer. A snapshot older than this says nothing about the ranks:
# no rank is named until a fresh one arrives (a dead monitor raises from ray.get instead).
SNAPSHOT_WAIT_S = 10.0
# A rank that has not beaten yet is starting: Ray is placing it, spawning its process or importing
# (minutes on a loaded node or a cold image); it is named after this long, or hang_timeout_s if longer.
START_S = 600.0


class Monitor:
    """Latest heartbeat per rank, with the monitor's receive time."""

    def __init__(self):
        self.beats: Dict[Key, Tuple[float, Dict[str, Any]]] = {}

    def beat(self, key: Key, report: Dict[str, Any]) -> None:
        self.beats[key] = (time.monotonic(), report)

    def snapshot(self) -> Dict[Key, Dict[str, Any]]:
        """Per rank: ``beat_age_s`` (since its last heartbeat), ``stalled_s`` (since its last
        tick, as of now) and its ``phase``. Ages, not times: the driver may be on another clock."""
        now = time.monotonic()
        return {key: {"beat_age_s": now - at, "stalled_s": now - at + r["idle_s"], "phase": r["phase"]}
                for key, (at, r) in self.beats.items()}


def heartbeat_sender(monitor, key: Key):
    """What a worker's heartbeat thread calls (fire and forget)."""
    return lambda report: monitor.beat.remote(key, report)


class Liveness:
    """The hang check of one run: ``hang_timeout_s`` and the monitor actor on the driver's node,
    read by a daemon thread (``megarl-liveness``); :meth:`close` stops it before Ray shuts down."""

    def __init__(self, hang_timeout_s: float, monitor=None):
        """``monitor``: the actor's handle (tests pass a stand-in); None: started here, on this node."""
        self.timeout_s = hang_timeout_s
        self.period_s = progress.heartbeat_period_s(hang_timeout_s)
        if monitor is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            monitor = ray.remote(Monitor).options(num_cpus=0, name=None, scheduling_strategy=here).remote()
        self.monitor = monitor
        self._lock = threading.Lock()  # the snapshot, read by the main thread and the one-step-off loop's drawing thread
        self._seen: Dict[Key, Dict[str, Any]] = {}
        self._seen_at = 0.0  # when it arrived (monotonic); 0: none yet
        self._error: Optional[BaseException] = None  # why the poll ended (a dead monitor): the waits raise it
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="megarl-liveness", daemon=True)
        self._poller.start()

    def heartbeat(self, key: Key):
        """What a worker calls to start its heartbeat thread, reporting as ``key``."""
        sender, period = heartbeat_sender(self.monitor, key), self.period_s
        return lambda: progress.start_heartbeat(sender, period)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the poll (idempotent). Called before ``ray.shutdown``: a Ray call after it ends the
        process. A poll stuck in Ray is left behind after ``timeout_s`` (a daemon thread)."""
        self._stop.set()
        poller = getattr(self, "_poller", None)
        if poller is not None and poller is not threading.current_thread():
            poller.join(timeout_s)

    def _poll(self) -> None:
        """The thread: a snapshot every ``period_s``, until :meth:`close` or the monitor fails."""
        while not self._stop.is_set():
            try:
                seen = self._snapshot()
            except Exception as err:  # noqa: BLE001 - the monitor died: the next wait on the ranks raises it
                with self._lock:
                    self._error = err
                return
            if seen is None:  # closed meanwhile
                return
            with self._lock:
                self._seen, self._seen_at = seen, time.monotonic()
            self._stop.wait(self.period_s)

    def _snapshot(self) -> Optional[Dict[Key, Dict[str, Any]]]:
        """One snapshot from the monitor, however long a loaded node takes to answer (a late one
        names no rank: see :meth:`stalled`); None if closed first."""
        import ray

        ref = self.monitor.snapshot.remote()
        while not self._stop.is_set():
            ready, _ = ray.wait([ref], timeout=0.2)  # short: close() waits for it
            if ready:
                return ray.get(ref)
        return None

    def stalled(self, waiting: Sequence[Key], since: float) -> Optional[Tuple[Key, float, Optional[str], Optional[float]]]:
        """The rank among ``waiting`` (pending in a wait that began at ``since``, monotonic) that
        has made no progress for ``hang_timeout_s``, preferring one whose heartbeat stopped: (key,
        seconds without progress, its phase, seconds since its heartbeat or None if it never beat);
        None when every rank is within its deadline. Reads the poll's latest snapshot: no Ray call,
        nothing that blocks (this runs on the driver's main thread, where Ctrl-C must land)."""
        with self._lock:
            error, seen, seen_at = self._error, self._seen, self._seen_at
        if error is not None:
            raise error
        now = time.monotonic()
        waited = now - since
        if waited < self.timeout_s or now - seen_at > SNAPSHOT_WAIT_S + self.period_s:
            return None  # within the deadline, or the monitor is late: its view is too old to blame a rank
        late = now - seen_at  # how old the snapshot is
        worst = None
        for key in waiting:
            info = seen.get(key)
            beat_age = None if info is None else info["beat_age_s"] + late
            stalled = waited if info is None else min(waited, info["stalled_s"] + late)
            if stalled < (max(self.timeout_s, START_S) if info is None else self.timeout_s):
                continue
            silent = beat_age is None or beat_age > 3 * self.period_s
            rank = (silent, beat_age or waited, stalled)
            if worst is None or rank > worst[0]:
                worst = (rank, key, stalled, info and info["phase"], beat_age)
        if worst is None:
            return None
        return worst[1:]
