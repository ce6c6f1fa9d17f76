"""Preemption: SIGTERM to the driver (Slurm's time limit or ``scancel --batch``, Kubernetes'
eviction) stops the run at the end of its current step, with a checkpoint, within a deadline.

:class:`Preemption` installs the handler for the life of a run. The first SIGTERM only asks: the
loop finishes its step, the driver writes a checkpoint (``trainer.save_on_signal``) and raises
:class:`Preempted`, which ``megarl train`` turns into exit 143 (128 + SIGTERM) and MLflow into
KILLED. If the step and the save have not finished by ``trainer.signal_grace_s`` (less the time
teardown takes), an alarm raises :class:`Preempted` wherever the driver is: it waits on its ranks
in one-second polls, so that lands within a second, and an unfinished checkpoint stays a ``.tmp``
that resume never picks. A second SIGTERM (more than 2 s later) raises at once. Before the loop starts (and after it
ends) there is no step to finish, and a SIGTERM raises at once too. A grace too short for the
measured step and checkpoint is warned of (:func:`grace_needed_s`, used by the checkpoint schedule).

Slurm's preemption and a plain ``scancel`` signal every step of a job: the Ray nodes' ranks stop
with the driver, so the step in progress cannot finish. A step that fails once a SIGTERM has come
(:meth:`Preemption.heard` waits briefly for one behind a rank found dead) is that stop, not a
crash: the run ends as preempted, naming the checkpoint it resumes from
(megarl.trainer.checkpoint.CheckpointSchedule.running).

Ctrl-C: :class:`InterruptNotice` tells the run's watchdog process of every SIGINT, and whether the
driver took it, so that a driver that cannot take it is stopped from outside.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 128 + signal.SIGTERM  # 143, as a process killed by SIGTERM reports in a shell
DUPLICATE_S = 2.0  # a second SIGTERM within this long is the first one again
# Ranks lost this long before the driver's own SIGTERM arrives are lost to it: Slurm signals each
# step of a job separately, and the driver may notice a dead rank first.
SIGNALS_APART_S = 0.5
GRACE_SPARE = 1.25  # the grace asked for: the measured step and save, a quarter more (they vary)


class Preempted(Exception):
    """The run stopped on SIGTERM; ``megarl train`` exits 143 (rerun to resume)."""


def teardown_margin_s(grace_s: float) -> float:
    """Of the grace, what is kept for stopping Ray and the workers after the deadline."""
    return min(30.0, grace_s / 4)


def grace_needed_s(work_s: float) -> float:
    """The shortest ``trainer.signal_grace_s`` whose deadline (the grace less
    :func:`teardown_margin_s`) holds ``work_s`` (the step in progress and its checkpoint, as
    measured) with :data:`GRACE_SPARE` to spare."""
    work = GRACE_SPARE * work_s
    return min(work + 30.0, work * 4 / 3)  # the inverse of grace - min(30, grace / 4) = max(grace - 30, 3 grace / 4)


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

    def heard(self, wait_s: float = SIGNALS_APART_S) -> bool:
        """Whether a SIGTERM has come, waiting up to ``wait_s`` for one (armed: the handler only
        notes it); for ranks found dead, which a preemption of every step kills beside the driver."""
        deadline = time.monotonic() + wait_s
        while self._installed and not self.requested and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.requested

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


# What the driver's SIGINT handler writes to the watchdog when it runs; a SIGINT itself arrives as
# its number (2), written by Python's C-level handler. Signal numbers stay below 65.
TAKEN = 0xFF


class InterruptNotice:
    """A pipe from the driver to its watchdog (:func:`megarl.runtime.processes.start_watchdog`)
    that tells it of Ctrl-C even when the driver's main thread is stuck in a native call.

    Python's C-level signal handler runs on arrival, whatever the main thread does, and writes the
    signal's number to the wakeup fd (``signal.set_wakeup_fd``); the Python-level handler, which
    raises KeyboardInterrupt, runs only when the main thread is back between bytecodes, and writes
    :data:`TAKEN`. A SIGINT not taken within the watchdog's deadline means a main thread that will
    not return (a call into Ray that never comes back, holding the GIL or not): the watchdog then
    stops the run's processes, and the driver. Main thread only (elsewhere it does nothing), and
    only over Python's own SIGINT handler (SIG_IGN, as in a background job, stays ignored). Its
    handler raises KeyboardInterrupt as Python's does; ``asyncio.run`` (the agent loop's), which
    sets its own only over Python's, then ends with the KeyboardInterrupt raised in its loop."""

    def __init__(self):
        self.read_fd: Optional[int] = None  # the watchdog's end, until :meth:`arm`
        self._write_fd: Optional[int] = None
        self._saved = None  # (SIGINT handler, wakeup fd) to put back
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._write_fd, False)  # set_wakeup_fd's requirement: a full pipe never blocks a handler

    def arm(self) -> None:
        """Once the watchdog holds the read end: report from now on."""
        if self._write_fd is None:
            return
        os.close(self.read_fd)
        self.read_fd = None
        handler = signal.getsignal(signal.SIGINT)
        wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._saved = (handler, wakeup)
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if self._write_fd is not None:
            with contextlib.suppress(OSError):  # the watchdog gone: nothing to tell
                os.write(self._write_fd, bytes([TAKEN]))
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt

    def close(self, current):
        """Stop reporting (idempotent). ``current``: the SIGINT handler in place; returns the one to
        put back (the handler from before :meth:`arm` when ``current`` is this one's). Main thread
        only: elsewhere the wakeup fd cannot be put back, so its pipe is left open."""
        if threading.current_thread() is not threading.main_thread():
            return current
        if self._saved is not None:
            handler, wakeup = self._saved
            self._saved = None
            signal.set_wakeup_fd(wakeup)
            if current == self._on_sigint:
                current = handler
        for fd in (self.read_fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self.read_fd = self._write_fd = None
        return current
