"""Helpers for the fault tests that drive ``megarl train`` as a subprocess (its own process
group, stdout and stderr in one log file)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def stderr(proc) -> str:
    """What the driver has written so far."""
    proc.log.seek(0)
    return proc.log.read()


def wait_exit(proc, limit_s: float) -> float:
    """Seconds until the driver exits; past ``limit_s`` its process group is killed and the test fails."""
    start_t = time.monotonic()
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the driver did not exit within {limit_s}s:\n{stderr(proc)[-3000:]}")
    return time.monotonic() - start_t
