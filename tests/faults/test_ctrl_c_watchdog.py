"""Ctrl-C on a driver that cannot take it (issue 25): the run's watchdog hears of every SIGINT
through the driver's :class:`~megarl.runtime.signals.InterruptNotice`, and of the driver taking it.

A driver whose main thread is stuck in a native call never runs Python's SIGINT handler (a run
was once found 20 s after Ctrl-C inside Ray's ``submit_actor_task``). Its watchdog then stops the
run's processes and, if that does not free the driver, the driver. A driver that takes the Ctrl-C
is left to its own cleanup and exit code.

No Ray here: a small driver with the real notice and watchdog, and one tagged process of its run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.distributed.launch import ROOT

WEDGED_S = 1.0  # the watchdog's deadline in these cases (a run's: processes.WEDGED_S)

DRIVER = r"""
import ctypes, os, subprocess, sys, time
from megarl.runtime.processes import RUN_TAG, start_watchdog
from megarl.runtime.signals import InterruptNotice

run_id, stuck, wedged_s = sys.argv[1], sys.argv[2] == "stuck", float(sys.argv[3])
notice = InterruptNotice()
watchdog = start_watchdog(run_id, notice.read_fd, wedged_s)
notice.arm()
ray_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=dict(os.environ, **{RUN_TAG: run_id}), start_new_session=True)
print(ray_like.pid, watchdog.pid, flush=True)
try:
    if stuck:  # a native call that never returns, holding the GIL, that signals do not break
        libc = ctypes.PyDLL(None)
        held = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER is all zeros (glibc)
        libc.pthread_mutex_lock(held)
        libc.pthread_mutex_lock(held)
    time.sleep(60)
except KeyboardInterrupt:
    ray_like.kill()
    ray_like.wait()
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(130)
"""


def _run(tmp_path, stuck: bool):
    log = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, f"ctrl-c-{os.getpid()}", "stuck" if stuck else "free",
                             str(WEDGED_S)], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    ray_like, watchdog = (int(p) for p in proc.stdout.readline().split())
    time.sleep(0.5)  # stuck by now
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    took = time.monotonic() - sent
    log.seek(0)
    return proc.returncode, took, log.read(), ray_like, watchdog


def _gone(pid: int, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.1)
    return not os.path.exists(f"/proc/{pid}")


def test_a_driver_stuck_in_a_native_call_is_stopped_with_its_run(tmp_path):
    rc, took, err, ray_like, watchdog = _run(tmp_path, stuck=True)
    assert rc == -signal.SIGKILL, err
    assert WEDGED_S <= took < WEDGED_S * 1.5 + 5, err  # the deadline, half as long again, and a loaded node's slack
    assert "Ctrl-C not taken by the driver" in err and "still stuck: killed" in err, err
    assert _gone(ray_like) and _gone(watchdog), err


def test_a_driver_that_takes_ctrl_c_is_left_to_its_own_exit(tmp_path):
    rc, took, err, ray_like, watchdog = _run(tmp_path, stuck=False)
    time.sleep(WEDGED_S * 2)  # past the deadline: the watchdog did nothing to the run
    assert rc == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert "not taken" not in err, err
    assert _gone(ray_like) and _gone(watchdog), err


def test_the_watchdog_starts_without_torch():
    """The watchdog (``python -m megarl.runtime.processes``) and the notice import no torch: a
    watchdog up in tens of milliseconds hears a Ctrl-C in a run's first seconds on a loaded node
    (with torch, its start took 3 s at a load of 10, and the Ctrl-C cases above timed out at 20)."""
    probe = "import sys, megarl.runtime.processes, megarl.runtime.signals; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
