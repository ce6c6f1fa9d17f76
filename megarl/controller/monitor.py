"""The driver's view of every rank's progress (``trainer.hang_timeout_s``; the mechanism is
described in :mod:`megarl.runtime.progress`).

:class:`Monitor` is a small Ray actor (no CPU slot) that keeps each rank's latest heartbeat;
:class:`Liveness` is the driver's side: while :func:`megarl.controller.group.wait_groups` waits on
ranks, it reads the monitor once per heartbeat period and names the first rank that has made no
progress for ``hang_timeout_s``.
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
    """The hang check of one run: ``hang_timeout_s`` and the monitor actor on the driver's node."""

    def __init__(self, hang_timeout_s: float):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.timeout_s = hang_timeout_s
        self.period_s = progress.heartbeat_period_s(hang_timeout_s)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.monitor = ray.remote(Monitor).options(num_cpus=0, name=None, scheduling_strategy=here).remote()
        self._lock = threading.Lock()  # the one-step-off loop's drawing thread waits on its ranks too
        self._asked = None  # a snapshot in flight
        self._asked_at = 0.0
        self._seen: Dict[Key, Dict[str, Any]] = {}
        self._seen_at = 0.0

    def heartbeat(self, key: Key):
        """What a worker calls to start its heartbeat thread, reporting as ``key``."""
        sender, period = heartbeat_sender(self.monitor, key), self.period_s
        return lambda: progress.start_heartbeat(sender, period)

    def _refresh(self) -> None:
        with self._lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        import ray

        now = time.monotonic()
        if self._asked is None and now - self._asked_at >= self.period_s:
            self._asked, self._asked_at = self.monitor.snapshot.remote(), now
        if self._asked is not None:
            ready, _ = ray.wait([self._asked], timeout=0)
            if ready:
                self._seen, self._seen_at, self._asked = ray.get(self._asked), time.monotonic(), None

    def stalled(self, waiting: Sequence[Key], since: float) -> Optional[Tuple[Key, float, Optional[str], Optional[float]]]:
        """The rank among ``waiting`` (pending in a wait that began at ``since``, monotonic) that
        has made no progress for ``hang_timeout_s``, preferring one whose heartbeat stopped: (key,
        seconds without progress, its phase, seconds since its heartbeat or None if it never beat);
        None when every rank is within its deadline."""
        self._refresh()
        now = time.monotonic()
        waited = now - since
        if waited < self.timeout_s or now - self._seen_at > SNAPSHOT_WAIT_S + self.period_s:
            return None  # within the deadline, or the monitor is late: its view is too old to blame a rank
        late = now - self._seen_at  # how old the snapshot is
        worst = None
        for key in waiting:
            info = self._seen.get(key)
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
