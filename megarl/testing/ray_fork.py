"""Test-only (``megarl.testing``): the tests' shared Ray cluster's workers, forked from a server that has imported torch, Megatron, Ray and
megarl once (``tests/distributed/zygote.py``), instead of each importing them anew.

Why: an end-to-end run's Ray workers (its ranks, rollout ranks, reward model) each spend about 5
CPU-seconds importing torch, megatron-core, Ray and megarl before they do anything, and the suite
starts a hundred and more of them on 2 cores.

How, with Ray's own parts only:
- :func:`runtime_env_hook` is the drivers' ``RAY_RUNTIME_ENV_HOOK``, set by
  :func:`tests.ray_cluster.shared` in the test process, so for its in-process drivers and every
  ``megarl`` it starts. For a ``ray.init`` given the shared cluster's address it sets the job's
  ``py_executable``, Ray's documented way to run workers through a command of one's own, to this
  file; any other job (a private cluster's: the demo, the fault suite) it leaves as it is. It lives
  in the package, not under ``tests/``, so that a driver without the tests on its path imports it.
- Ray's ``setup_worker.py`` then execs ``python tests/ray_fork.py default_worker.py ARGS`` in place
  of ``python default_worker.py ARGS``. :func:`main` sends the server its arguments, environment,
  directory and standard streams (the log files the raylet opened), and the server forks the
  worker. The worker registers with the raylet under its own PID, which the raylet then signals
  and kills; this process relays signals sent to it and ends with the worker's exit status, and
  the server kills the worker if this process dies first (``bound``).
- Only the shared cluster's raylet carries ``SOCKET_ENV`` (:mod:`tests.ray_cluster`). A worker whose
  import-time environment differs from the server's (``OMP_*``, ``PYTHON*``, ...: a reward worker
  without megarl's ``OMP_NUM_THREADS=1``) is started by ``exec`` as before.

A forked worker is still a process of its own: Ray's worker entry point runs as ``__main__`` with
its own argv, environment, directory, streams, PID and exit code. What it does not have is the
tag in ``/proc/<pid>/environ`` of the variables Ray set for it (the kernel keeps a process's
environment as it was at exec), so the shared cluster's workers are found by the cluster's tag
(the server's) and by the raylet, not by a run's ``MEGARL_RUN_ID``; the runs whose subject is their
own cleanup run on private clusters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "MEGARL_TEST_RAY_FORK"
SHARED_ADDRESS_ENV = "MEGARL_TEST_SHARED_RAY"
CLIENT_ENV = "MEGARL_TEST_RAY_FORK_CLIENT"  # in a forked worker: the PID the raylet started
HOOK = "megarl.testing.ray_fork.runtime_env_hook"
ANSWER_S = 60.0
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Imported by the server beside the ranks' preload. Not Ray: its C++ config (the job's ID among it)
# is read from the environment once, when ``ray._raylet`` loads, so each worker loads Ray itself.
PRELOAD = ("megarl.controller.rollout_worker", "megarl.controller.sft_worker")


def _init_address():
    """The ``address`` that the ``ray.init`` calling the hook was given (Ray passes the hook the
    runtime_env only)."""
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "init" and "ray" in frame.f_code.co_filename):
        frame = frame.f_back
    return frame.f_locals.get("address") if frame is not None else None


def runtime_env_hook(runtime_env):
    """``RAY_RUNTIME_ENV_HOOK``: a job on the shared cluster (``SHARED_ADDRESS_ENV``) starts its
    workers through :func:`main`; any other job (a private cluster's) is left as it is."""
    shared = os.environ.get(SHARED_ADDRESS_ENV)
    if not shared or _init_address() != shared:
        return runtime_env
    runtime_env = dict(runtime_env or {})
    runtime_env.setdefault("py_executable", f"{sys.executable} {os.path.abspath(__file__)}")
    return runtime_env


def _forked(argv) -> None:
    """Ask the server for the worker; relay to it and exit with its status. Returns where the
    server refuses (another import-time environment) or cannot be reached."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ANSWER_S)
    env = dict(os.environ, **{CLIENT_ENV: str(os.getpid())})
    request = {"argv": list(argv), "env": env, "cwd": os.getcwd(), "stdio_fds": True, "bound": True,
               "check_env": True, "own_group": True}
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        buffer = b""
        while b"\n" not in buffer:
            chunk = conn.recv(4096)
            if not chunk:
                return
            buffer += chunk
    except OSError as error:
        sys.stderr.write(f"ray_fork: the fork server at {path} did not answer ({error}); starting anew\n")
        return
    line, _, buffer = buffer.partition(b"\n")
    answer = json.loads(line)
    if "pid" not in answer:
        sys.stderr.write(f"ray_fork: not forked ({answer}); starting anew\n")
        return
    pid = answer["pid"]
    for sig in RELAYED:
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    conn.settimeout(None)  # the worker's lifetime, which Ray bounds
    while b"\n" not in buffer:
        chunk = conn.recv(4096)
        if not chunk:  # the server is gone, and with it the worker
            os._exit(1)
        buffer += chunk
    code = json.loads(buffer.partition(b"\n")[0])["exit"]
    if code < 0:  # ended by a signal: end by the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    argv = sys.argv[1:]
    _forked(argv)
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main()
