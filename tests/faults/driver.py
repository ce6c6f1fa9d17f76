"""Helpers for the fault tests that drive ``megarl train`` as a subprocess (its own process
group, stdout and stderr in one log file)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def stderr(proc) -> str:
    """What the driver has written so far."""
    proc.log.seek(0)
    return proc.log.read()


DIAGNOSE_ENV = {"PYTHONFAULTHANDLER": "1"}  # a driver started with it dumps every thread's stack on SIGABRT


def wait_exit(proc, limit_s: float) -> float:
    """Seconds until the driver exits; past ``limit_s`` the test fails, with where the driver was:
    it is sent SIGABRT first (with :data:`DIAGNOSE_ENV`, Python's faulthandler writes every
    thread's stack to its stderr), then its process group is killed."""
    start_t = time.monotonic()
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):  # not gone in 5 s: the SIGKILL below ends it
            proc.wait(timeout=5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the driver did not exit within {limit_s}s:\n{stderr(proc)[-6000:]}")
    return time.monotonic() - start_t
