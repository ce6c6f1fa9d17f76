"""megarl.checkpoint.results_queue: megatron-core's dist-checkpoint writer reports through a
Manager queue started by fork (spawn re-imported the main module: 3.6 s and 4.7 s of CPU on each
rank's first save, measured). The Manager holds none of its parent's sockets, and dies with it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megarl.runtime.processes import exited as gone

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, socket, sys, time
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # a connection of the parent's: the Manager must not keep it open
    from megarl.checkpoint import results_queue
    results_queue.install()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    start = time.monotonic()
    queue = filesystem_async._get_write_results_queue()
    took = time.monotonic() - start
    queue.put({"written": 1})
    got = queue.get_nowait()
    inode = os.fstat(listener.fileno()).st_ino
    print(results_queue.manager._process.pid, inode, f"{took:.3f}", got["written"], flush=True)
    time.sleep(60)
""")


def sockets_of(pid: int) -> set:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[len("socket:["):-1]))
    return found


def test_the_writers_queue_is_forked_keeps_no_parent_socket_and_dies_with_its_parent():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    try:
        ready = select.select([proc.stdout], [], [], 60)[0]
        assert ready, "the script printed nothing in 60 s: the forked Manager did not start"
        manager, inode, took, written = proc.stdout.readline().split()
        manager = int(manager)
        assert int(written) == 1
        assert float(took) < 1.0, took  # a fork; a spawn re-imports megatron-core (seconds)
        assert open(f"/proc/{manager}/status").read().count(f"PPid:\t{proc.pid}") == 1
        assert int(inode) in sockets_of(proc.pid) and int(inode) not in sockets_of(manager)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not gone(manager) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(manager)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


HANGS = textwrap.dedent("""
    import sys, time
    from megarl.checkpoint import results_queue
    results_queue.START_DEADLINE_S = 1.0
    results_queue._close_inherited_sockets = lambda: time.sleep(600)  # a child deadlocked after the fork
    start = time.monotonic()
    try:
        results_queue.write_results_queue()
    except RuntimeError as e:
        print(f"{time.monotonic() - start:.2f}", results_queue.manager, e, flush=True)
        sys.exit(0)
    sys.exit(1)
""")


def test_a_manager_that_never_answers_is_killed_at_the_deadline_and_named():
    """The forked Manager's start has a deadline (the stdlib reads the child's address with none):
    a child stuck after the fork is killed, and the save fails naming the queue."""
    done = subprocess.run([sys.executable, "-c", HANGS], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout + done.stderr
    took, manager, message = done.stdout.split(" ", 2)
    assert 1.0 <= float(took) < 10.0, took
    assert manager == "None"  # no half-started Manager is kept
    assert "results queue" in message and "did not start within 1 s" in message, message
