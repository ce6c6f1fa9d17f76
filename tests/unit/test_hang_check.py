"""The hang check's rules (megarl.runtime.progress, megarl.controller.monitor) and the SIGTERM
handler (megarl.runtime.signals), without Ray; the real runs are in tests/faults and tests/e2e."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megarl.controller import monitor as mon
from megarl.runtime import progress
from megarl.runtime.signals import Preempted, Preemption


def test_phase_and_ticks_are_reported():
    with progress.phase("actor.update"):
        before = progress.report()
        progress.tick()
        after = progress.report()
        assert after["phase"] == "actor.update" and after["ticks"] == before["ticks"] + 1 and after["idle_s"] < 1
    assert progress.report()["phase"] is None


def liveness(timeout_s: float, seen: dict, seen_age_s: float = 0.0) -> mon.Liveness:
    """A Liveness whose monitor answered ``seen`` ``seen_age_s`` ago (no Ray, no poll thread: no
    new snapshot arrives, however slow the test)."""
    live = object.__new__(mon.Liveness)
    live._lock = threading.Lock()
    live.timeout_s, live.period_s = timeout_s, progress.heartbeat_period_s(timeout_s)
    live._seen, live._seen_at, live._error = seen, time.monotonic() - seen_age_s, None
    return live


def test_monitor_snapshot_ages():
    m = mon.Monitor()
    m.beat(("", 0), {"phase": "rollout.generate", "ticks": 5, "idle_s": 3.0})
    (info,) = m.snapshot().values()
    assert info["phase"] == "rollout.generate" and 0 <= info["beat_age_s"] < 1 and 3.0 <= info["stalled_s"] < 4


def test_a_silent_rank_is_named_before_a_stalled_one():
    seen = {("", 0): {"beat_age_s": 0.1, "stalled_s": 40.0, "phase": "actor.update"},  # alive, stuck in a collective
            ("", 1): {"beat_age_s": 35.0, "stalled_s": 36.0, "phase": "actor.update"}}  # stopped
    start = time.monotonic()
    key, seconds, phase, beat_age = liveness(30, seen).stalled([("", 0), ("", 1)], since=start - 60)
    # the snapshot's ages plus its age when read (however long a loaded machine took to get here)
    assert key == ("", 1) and phase == "actor.update" and 36 <= seconds <= 36 + time.monotonic() - start
    assert beat_age >= 35
    assert "its heartbeat stopped" in progress.describe_stall(seconds, phase, beat_age, 3.75)
    assert "answers heartbeats" in progress.describe_stall(40, phase, 0.1, 3.75)


def test_a_late_monitor_names_no_rank():
    """A monitor slowed by a loaded node (its snapshot is old) is no evidence against a rank: no
    error and no hang is named until a fresh snapshot arrives."""
    seen = {("", 0): {"beat_age_s": 35.0, "stalled_s": 36.0, "phase": "actor.update"}}
    live = liveness(30, seen, seen_age_s=mon.SNAPSHOT_WAIT_S + progress.heartbeat_period_s(30) + 1)
    assert live.stalled([("", 0)], since=time.monotonic() - 60) is None
    assert liveness(30, seen).stalled([("", 0)], since=time.monotonic() - 60)[0] == ("", 0)


def test_no_hang_within_the_deadline_or_before_the_wait_began():
    seen = {("", 0): {"beat_age_s": 0.1, "stalled_s": 500.0, "phase": None}}  # idle between calls for long
    live = liveness(30, seen)
    assert live.stalled([("", 0)], since=time.monotonic() - 10) is None  # the wait began 10 s ago
    assert live.stalled([("", 0)], since=time.monotonic() - 31) is not None
    assert liveness(30, {("", 0): {"beat_age_s": 0.1, "stalled_s": 2.0, "phase": "x"}}).stalled(
        [("", 0)], since=time.monotonic() - 100) is None  # it advances


def test_a_rank_that_never_beat_is_starting_until_start_s():
    live = liveness(30, {})
    assert live.stalled([("rollout", 1)], since=time.monotonic() - 100) is None
    key, seconds, phase, beat_age = live.stalled([("rollout", 1)], since=time.monotonic() - mon.START_S - 1)
    assert key == ("rollout", 1) and beat_age is None and phase is None
    assert "never started" in progress.describe_stall(seconds, "setup", beat_age, live.period_s)


class _Ref:
    """An object ref of the stand-in monitor: its value, or the error ``ray.get`` raises."""

    def __init__(self, value):
        self.value = value


class _Monitor:
    """The monitor actor's handle as the poll uses it: ``snapshot.remote()``."""

    def __init__(self, answer):
        self.snapshot = type("Method", (), {"remote": staticmethod(lambda: _Ref(answer()))})()


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.wait / ray.get of :class:`_Ref` (the poll thread's only other Ray calls)."""
    import ray

    def get(ref):
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value

    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (list(refs), []))
    monkeypatch.setattr(ray, "get", get)


def _until(condition, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "not within the limit"
        time.sleep(0.01)


def test_the_poll_thread_brings_snapshots_and_a_dead_monitor_raises_in_the_wait(fake_ray):
    stopped = {("", 1): {"beat_age_s": 40.0, "stalled_s": 41.0, "phase": "actor.update"}}
    live = mon.Liveness(1.6, monitor=_Monitor(lambda: stopped))  # a snapshot every 0.2 s
    try:
        assert live._poller.name == "megarl-liveness" and live._poller.daemon
        _until(lambda: live.stalled([("", 1)], since=time.monotonic() - 60) is not None)
        assert live.stalled([("", 1)], since=time.monotonic() - 60)[0] == ("", 1)
    finally:
        live.close()
    assert not live._poller.is_alive()

    died = RuntimeError("the monitor actor died")
    live = mon.Liveness(1.6, monitor=_Monitor(lambda: died))
    try:
        _until(lambda: not live._poller.is_alive())  # the poll ends with the monitor
        with pytest.raises(RuntimeError, match="the monitor actor died"):
            live.stalled([("", 1)], since=time.monotonic())
    finally:
        live.close()


# A driver's wait on its ranks while the hang check's call into Ray never returns: the monitor's
# submission blocks in a native wait that signals do not break (a pthread mutex already held), as
# the driver of a failed run was found, 20 s after Ctrl-C, in Ray's submit_actor_task.
STUCK_POLL = r"""
import ctypes, os, sys, time
from megarl.controller import monitor as mon

libc = ctypes.CDLL(None)
held = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER is all zeros (glibc)
libc.pthread_mutex_lock(held)


class Method:
    @staticmethod
    def remote():
        os.write(1, b"stuck\n")  # one write: the main thread writes too
        libc.pthread_mutex_lock(held)  # never returns


class Monitor:
    snapshot = Method()


live = mon.Liveness(30.0, monitor=Monitor())
since = time.monotonic()
os.write(1, b"waiting\n")
try:
    while True:  # wait_groups: ray.wait for up to a second, then the hang check
        assert live.stalled([("", 0)], since) is None  # no snapshot: no rank is named
        time.sleep(0.05)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_reaches_a_wait_whose_hang_check_is_stuck_in_ray():
    """The hang check's Ray calls run on a thread of its own: the main thread, where Python runs
    signal handlers, stays free. (Polled from the main thread, as before, this waits forever.)"""
    proc = subprocess.Popen([sys.executable, "-c", STUCK_POLL], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert {proc.stdout.readline().strip() for _ in range(2)} == {"waiting", "stuck"}
        time.sleep(0.2)  # the poll is inside its call for good
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_collectives_time_out_after_the_hang_check():
    for hang in (10, 1800):
        assert progress.collective_timeout_s(hang) >= hang + 60
        assert progress.heartbeat_period_s(hang) * 3 < hang


def test_sigterm_outside_a_step_raises_at_once():
    stop = Preemption(grace_s=30)
    try:
        with pytest.raises(Preempted, match="outside a step"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_in_a_step_asks_then_the_grace_runs_out(capsys):
    stop = Preemption(grace_s=0.8)  # the alarm at 0.6 s (a quarter kept for teardown)
    stop.armed = True
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and "finishing the current step" in capsys.readouterr().err
        os.kill(os.getpid(), signal.SIGTERM)  # the same stop delivered twice: ignored
        with pytest.raises(Preempted, match="did not finish within trainer.signal_grace_s=0.8"):
            time.sleep(5)
    finally:
        stop.close()
