"""Preemption: SIGTERM to the driver (Slurm's time limit or ``scancel --batch``, Kubernetes'
eviction) stops the run at the end of its current step, with a checkpoint, within a deadline.

:class:`Preemption` installs the handler for the life of a run. The first SIGTERM only asks: the
loop finishes its step, the driver writes a checkpoint (``trainer.save_on_signal``) and raises
:class:`Preempted`, which ``megarl train`` turns into exit 143 (128 + SIGTERM) and MLflow into
KILLED. If the step and the save have not finished by ``trainer.signal_grace_s`` (less the time
teardown takes), an alarm raises :class:`Preempted` wherever the driver is: it waits on its ranks
in one-second polls, so that lands within a second, and an unfinished checkpoint stays a ``.tmp``
that resume never picks. A second SIGTERM (more than 2 s later) raises at once. Before the loop starts (and after it
ends) there is no step to finish, and a SIGTERM raises at once too.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 128 + signal.SIGTERM  # 143, as a process killed by SIGTERM reports in a shell
DUPLICATE_S = 2.0  # a second SIGTERM within this long is the first one again


class Preempted(Exception):
    """The run stopped on SIGTERM; ``megarl train`` exits 143 (rerun to resume)."""


def teardown_margin_s(grace_s: float) -> float:
    """Of the grace, what is kept for stopping Ray and the workers after the deadline."""
    return min(30.0, grace_s / 4)


class Preemption:
    """The run's SIGTERM handler (main thread only; elsewhere it does nothing). ``armed`` while
    the loop runs: a SIGTERM then waits for the step's end (:attr:`requested`)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.armed = False
        self.requested_at: Optional[float] = None
        self._installed = threading.current_thread() is threading.main_thread()
        self._previous = {}
        if self._installed:
            self._previous = {signal.SIGTERM: signal.getsignal(signal.SIGTERM),
                              signal.SIGALRM: signal.getsignal(signal.SIGALRM)}
            self.install()

    def install(self) -> None:
        """(Again:) a library that set its own handler meanwhile loses it. Ray's core worker
        installs one for SIGTERM that aborts the driver with a stack trace (exit 134)."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._on_term)
            signal.signal(signal.SIGALRM, self._on_alarm)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _on_term(self, signum, frame) -> None:
        if self.requested:
            if time.monotonic() - self.requested_at < DUPLICATE_S:
                return  # the same stop, delivered twice (plain scancel: to the batch shell, which forwards it, and here)
            raise Preempted("SIGTERM again: stopped at once, without a checkpoint of the step in progress")
        if not self.armed:
            raise Preempted("SIGTERM outside a step: stopped at once")
        self.requested_at = time.monotonic()
        deadline = self.grace_s - teardown_margin_s(self.grace_s)
        signal.setitimer(signal.ITIMER_REAL, max(deadline, 0.1))
        print(f"megarl: SIGTERM: finishing the current step, then a checkpoint; exit within "
              f"{self.grace_s:g} s (trainer.signal_grace_s)", file=sys.stderr, flush=True)

    def _on_alarm(self, signum, frame) -> None:
        raise Preempted(f"SIGTERM: the step and its checkpoint did not finish within trainer.signal_grace_s="
                        f"{self.grace_s:g} s; stopped without a checkpoint of it (the previous one stays)")

    def close(self) -> None:
        """Disarm the alarm and put the previous handlers back."""
        if self._installed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            self._installed = False
