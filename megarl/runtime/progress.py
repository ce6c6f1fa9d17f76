"""What a worker's main thread is doing, and since when, for the driver's hang check.

The mechanism: each worker's main thread marks progress (:func:`tick`) where work advances: a
verb begun or ended (:func:`phase`), a micro-batch, a decode step, a weight bucket. A daemon
thread of the worker (:func:`start_heartbeat`) sends the driver's monitor (a small Ray actor,
:mod:`megarl.controller.monitor`) the phase and how long ago the last tick was, every few
seconds. The driver then tells two hangs apart:

- a process that is stopped or wedged (SIGSTOP, a GPU that no longer answers, a stuck network
  file system, the GIL never released): its heartbeats stop;
- a process that is alive but stuck (a collective that never completes): it beats, and its ticks
  stand still.

Why heartbeats and not only the process groups' timeouts (gloo and NCCL take ``timeout=``): a
collective's timeout fires on the survivors, who cannot say which peer failed, and only inside a
collective; a rank frozen between collectives, or the driver waiting on a rank that never enters
one, is never timed out. The process groups keep a timeout as a backstop, a little longer than
the heartbeat deadline (:func:`collective_timeout_s`), so that the driver names the rank first.

Nothing here imports Ray: the engines tick also where no driver listens (torchrun, tests).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Optional

_state: Dict[str, Any] = {"phase": None, "ticks": 0, "at": time.monotonic()}


def tick() -> None:
    """The main thread advanced (cheap: two assignments)."""
    _state["ticks"] += 1
    _state["at"] = time.monotonic()


@contextlib.contextmanager
def phase(name: str):
    """``name`` (``actor.update``, ``rollout.generate``) is what this rank is doing in the body."""
    previous = _state["phase"]
    _state["phase"] = name
    tick()
    try:
        yield
    finally:
        _state["phase"] = previous
        tick()


def report() -> Dict[str, Any]:
    """The phase (None between verbs), the ticks so far and the seconds since the last one."""
    return {"phase": _state["phase"], "ticks": _state["ticks"], "idle_s": time.monotonic() - _state["at"]}


def heartbeat_period_s(hang_timeout_s: float) -> float:
    """How often a worker reports: often enough that a stopped one is seen well within the deadline."""
    return max(0.2, min(5.0, hang_timeout_s / 8))


def collective_timeout_s(hang_timeout_s: float) -> float:
    """The process groups' timeout: the backstop, after the heartbeat deadline has named the rank."""
    return hang_timeout_s + max(60.0, 0.1 * hang_timeout_s)


def start_heartbeat(send: Callable[[Dict[str, Any]], Any], period_s: float) -> threading.Thread:
    """A daemon thread calling ``send(report())`` every ``period_s``; a failing send (the driver
    going away) ends nothing: the process is killed with its run."""

    def beat() -> None:
        while True:
            try:
                send(report())
            except Exception:  # noqa: BLE001 - the monitor is gone: the run is ending
                pass
            time.sleep(period_s)

    thread = threading.Thread(target=beat, name="megarl-heartbeat", daemon=True)
    thread.start()
    return thread


def describe_stall(seconds: float, where: str, beat_age_s: Optional[float], period_s: float) -> str:
    """The part of a hang's message after ``rank R (pid P on node N)``; ``beat_age_s``: seconds since
    its last heartbeat, None if it never beat."""
    if beat_age_s is None:
        how = "it never started: no heartbeat since the run asked Ray for it"
    elif beat_age_s > 3 * period_s:
        how = ("its heartbeat stopped: the process is stopped or wedged (SIGSTOP, a device that no longer "
               "answers, a stuck file system)")
    else:
        how = "it answers heartbeats but has not advanced: a collective that never completes?"
    return f"made no progress for {seconds:.0f} s in {where} ({how})"
