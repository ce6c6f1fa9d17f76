"""Run a script as ``nproc`` ranks on CPU from a test, with output kept for the failure message.

The ranks are started directly, as ``srun`` starts them: each gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (loopback) and ``MASTER_PORT``, and
:func:`megarl.runtime.init_distributed` rendezvous through its own store on rank 0. The launcher
listens on that port itself and hands the socket to rank 0 (``MEGARL_STORE_FD``): a port found free
and closed again can be taken by another process's outgoing connection before rank 0, seconds
later, binds it (seen as "Address already in use" beside other jobs). torchrun's
agent would cost each launch one more process that imports all of torch (3-4 s here, before any
rank starts); torchrun itself is run by ``tests/e2e/test_launch.py`` through ``launch/torchrun.sh``.
As torchrun does, the ranks still running when one fails are stopped (after ``FAIL_GRACE_S``).

The ranks are forked from the suite's fork server (``tests/distributed/zygote.py``), which has
imported torch, Megatron and megarl once: each rank is still a process of its own with its own
environment, streams and exit code, without 4-6 CPU-s of imports. ``MEGARL_TEST_FORK=0`` starts
each rank as a new interpreter instead; an environment that differs from the server's in a
variable read at import time gets a new server, started with it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megarl.runtime.distributed import STORE_FD_ENV
from tests.distributed import zygote

ROOT = Path(__file__).resolve().parents[2]
FAIL_GRACE_S = 30.0  # the others' time to fail on their own (a collective's error) once one has
POLL_S = 0.05


ZYGOTE_START_S = 120.0  # the server's imports, on a loaded host
ANSWER_S = 60.0  # the server's answer to a request (a pid), and a killed rank's exit status


class ForkServer:
    """A fork server (``tests/distributed/zygote.py``) started with ``env``, importing ``preload``
    beside its own list; :attr:`path` is its socket."""

    def __init__(self, env: dict, preload=()):
        self.env = env
        self.dir = tempfile.mkdtemp(prefix="zygote")
        if len(self.dir) > 90:  # a Unix socket's path has at most 107 bytes
            os.rmdir(self.dir)
            self.dir = tempfile.mkdtemp(prefix="zygote", dir="/tmp")
        self.path = os.path.join(self.dir, "socket")
        self.log = open(os.path.join(self.dir, "server.err"), "w")
        self.proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "tests/distributed/zygote.py"), self.path,
                                      *preload],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log)
        ready = threading.Timer(ZYGOTE_START_S, self.proc.kill)
        ready.start()
        line = self.proc.stdout.readline()
        ready.cancel()
        if line != b"ready\n":
            self.proc.kill()
            raise RuntimeError(f"the rank fork server did not start within {ZYGOTE_START_S:.0f}s: "
                               f"{open(self.log.name).read()[-3000:]}")
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()  # the server kills its ranks and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class _Forked:
    """A rank forked by the server, with the part of ``subprocess.Popen`` that :func:`torchrun`
    uses (``poll``, ``kill``, ``wait``, ``returncode``)."""

    def __init__(self, server: ForkServer, argv, env: dict, cwd: Path, stdout, stderr, fds=()):
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": stdout.name, "stderr": stderr.name,
                   "fd_env": STORE_FD_ENV}
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(ANSWER_S)
        self.conn.connect(server.path)
        socket.send_fds(self.conn, [json.dumps(request).encode() + b"\n"], list(fds))
        self.returncode, self._buffer = None, b""
        self.pid = self._message()["pid"]  # the exit status may have come with it: kept in the buffer
        self.conn.setblocking(False)

    def _message(self):
        """The server's next line, or None if it has not come yet (non-blocking)."""
        while b"\n" not in self._buffer:
            try:
                chunk = self.conn.recv(4096)
            except (BlockingIOError, TimeoutError):
                if self.conn.gettimeout() == 0:  # polled: nothing yet
                    return None
                raise RuntimeError(f"the rank fork server did not answer within {ANSWER_S:.0f}s") from None
            if not chunk:
                raise RuntimeError("the rank fork server closed the connection of a rank without its exit status")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def poll(self):
        if self.returncode is None:
            message = self._message()
            if message is not None:
                self.returncode = message["exit"]
                self.conn.close()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it has exited, its status not read yet
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = ANSWER_S):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank pid {self.pid}: no exit status from the fork server within {timeout:.0f}s")
            time.sleep(POLL_S)
        return self.returncode


_ZYGOTE = None


_ZYGOTE_LOCK = threading.Lock()  # sessions launch ranks from two threads (test_layout_parity)
RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", STORE_FD_ENV)


def _server(env: dict):
    """The fork server for ranks with ``env``, or None where new interpreters must start them
    (``MEGARL_TEST_FORK=0``). A server whose import-time environment is not ``env``'s, or that is
    gone (a run's teardown kills the processes that carry its tag, the server included if it was
    started while the tag was set), is replaced by one started with ``env``."""
    global _ZYGOTE
    if os.environ.get("MEGARL_TEST_FORK", "1") == "0":
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive() or not zygote.forkable(env, _ZYGOTE.env):
            if _ZYGOTE is not None:
                _ZYGOTE.close()
            _ZYGOTE = ForkServer({k: v for k, v in env.items() if k not in RANK_KEYS})
        return _ZYGOTE


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def torchrun(nproc: int, script: str, *args: str, timeout: int = 900) -> str:
    """Run ``script`` with ``nproc`` ranks; return their stdout (rank 0's first), or raise with
    each failed rank's exit code and the output's tail."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)  # rank 0's store takes it over
    base = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(server.getsockname()[1]))
    cmd = [sys.executable, "-u", str(ROOT / script), *args]
    with tempfile.TemporaryDirectory(prefix="ranks") as tmp, server:
        outs = [open(Path(tmp) / f"{rank}.out", "w+") for rank in range(nproc)]
        errs = [open(Path(tmp) / f"{rank}.err", "w+") for rank in range(nproc)]
        procs, fork = [], _server(base)
        for rank in range(nproc):
            env, fds = dict(base, RANK=str(rank), LOCAL_RANK=str(rank)), ()
            if rank == 0:
                env[STORE_FD_ENV], fds = str(server.fileno()), (server.fileno(),)
            if fork is not None:
                procs.append(_Forked(fork, cmd[2:], env, ROOT, outs[rank], errs[rank], fds))
                continue
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, pass_fds=fds, stdout=outs[rank], stderr=errs[rank],
                                          stdin=subprocess.DEVNULL))
        server.close()  # rank 0 holds its own copy
        deadline, failed_at, why = time.monotonic() + timeout, None, ""
        failed = []  # ranks in the order they were seen failing
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed += [rank for rank, code in enumerate(codes) if code and rank not in failed]
                if all(code is not None for code in codes):
                    break
                now = time.monotonic()
                if failed and failed_at is None:
                    failed_at = now
                if now > deadline:
                    why = f"timed out after {timeout}s"
                    break
                if failed_at is not None and now > failed_at + FAIL_GRACE_S:
                    why = f"stopped the ranks still running {FAIL_GRACE_S:.0f}s after one failed"
                    break
                time.sleep(POLL_S)
        finally:
            _stop(procs)
        codes = [p.returncode for p in procs]
        texts = {}
        for name, files in (("out", outs), ("err", errs)):
            for rank, f in enumerate(files):
                f.seek(0)
                texts[name, rank] = f.read()
                f.close()
    stdout = "".join(texts["out", rank] for rank in range(nproc))
    if why or any(codes):
        bad = {rank: code for rank, code in enumerate(codes) if code}
        # the ranks that failed first in the message, each with its own stderr's tail
        order = failed + [rank for rank in bad if rank not in failed] + [rank for rank in range(nproc) if not codes[rank]]
        errors = "".join(f"\n--- rank {rank} stderr (exit {codes[rank]}):\n{texts['err', rank][-3000:]}"
                         for rank in order[:3])
        raise AssertionError(f"{nproc} ranks of {script} {' '.join(args)} failed (exit codes by rank {bad}"
                             f"{'; ' + why if why else ''}):\n{stdout[-4000:]}{errors}")
    return stdout
