"""The hang check's rules (megarl.runtime.progress, megarl.controller.monitor) and the SIGTERM
handler (megarl.runtime.signals), without Ray; the real runs are in tests/faults and tests/e2e."""

from __future__ import annotations

import os
import signal
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
    """A Liveness whose monitor answered ``seen`` ``seen_age_s`` ago (no Ray)."""
    live = object.__new__(mon.Liveness)
    live._lock = threading.Lock()
    live.timeout_s, live.period_s = timeout_s, progress.heartbeat_period_s(timeout_s)
    live._asked, live._asked_at = None, float("inf")  # no new snapshot is ever asked for, however slow the test
    live._seen, live._seen_at = seen, time.monotonic() - seen_age_s
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
