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
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

from megarl.runtime.distributed import STORE_FD_ENV

ROOT = Path(__file__).resolve().parents[2]
FAIL_GRACE_S = 30.0  # the others' time to fail on their own (a collective's error) once one has
POLL_S = 0.05


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


class Ranks:
    """``script`` started as ``nproc`` ranks; :meth:`wait` for their stdout (rank 0's first), or an
    error with each failed rank's exit code and the output's tail."""

    def __init__(self, nproc: int, script: str, *args: str, timeout: int = 900):
        self.nproc, self.script, self.args = nproc, script, args
        server = socket.create_server(("127.0.0.1", 0), backlog=128)  # rank 0's store takes it over
        base = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                    WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(server.getsockname()[1]))
        cmd = [sys.executable, "-u", str(ROOT / script), *args]
        self.tmp = tempfile.TemporaryDirectory(prefix="ranks")
        self.outs = [open(Path(self.tmp.name) / f"{rank}.out", "w+") for rank in range(nproc)]
        self.errs = [open(Path(self.tmp.name) / f"{rank}.err", "w+") for rank in range(nproc)]
        self.procs = []
        with server:  # closed here once rank 0 holds its own copy
            for rank in range(nproc):
                env, fds = dict(base, RANK=str(rank), LOCAL_RANK=str(rank)), ()
                if rank == 0:
                    env[STORE_FD_ENV], fds = str(server.fileno()), (server.fileno(),)
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, pass_fds=fds, stdout=self.outs[rank],
                                                   stderr=self.errs[rank], stdin=subprocess.DEVNULL))
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout

    def wait(self) -> str:
        failed_at, why = None, ""
        failed = []  # ranks in the order they were seen failing
        procs = self.procs
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed += [rank for rank, code in enumerate(codes) if code and rank not in failed]
                if all(code is not None for code in codes):
                    break
                now = time.monotonic()
                if failed and failed_at is None:
                    failed_at = now
                if now > self.deadline:
                    why = f"timed out after {self.timeout}s"
                    break
                if failed_at is not None and now > failed_at + FAIL_GRACE_S:
                    why = f"stopped the ranks still running {FAIL_GRACE_S:.0f}s after one failed"
                    break
                time.sleep(POLL_S)
        finally:
            _stop(procs)
        codes = [p.returncode for p in procs]
        texts = {}
        for name, files in (("out", self.outs), ("err", self.errs)):
            for rank, f in enumerate(files):
                f.seek(0)
                texts[name, rank] = f.read()
        self.close()
        nproc = self.nproc
        stdout = "".join(texts["out", rank] for rank in range(nproc))
        if why or any(codes):
            bad = {rank: code for rank, code in enumerate(codes) if code}
            # the ranks that failed first in the message, each with its own stderr's tail
            order = failed + [rank for rank in bad if rank not in failed] + [rank for rank in range(nproc) if not codes[rank]]
            errors = "".join(f"\n--- rank {rank} stderr (exit {codes[rank]}):\n{texts['err', rank][-3000:]}"
                             for rank in order[:3])
            raise AssertionError(f"{nproc} ranks of {self.script} {' '.join(self.args)} failed (exit codes by rank "
                                 f"{bad}{'; ' + why if why else ''}):\n{stdout[-4000:]}{errors}")
        return stdout

    def close(self) -> None:
        """Stop the ranks still running and drop their output files."""
        _stop(self.procs)
        for f in self.outs + self.errs:
            f.close()
        self.tmp.cleanup()


def torchrun(nproc: int, script: str, *args: str, timeout: int = 900) -> str:
    """Run ``script`` with ``nproc`` ranks; return their stdout (rank 0's first), or raise with
    each failed rank's exit code and the output's tail."""
    return Ranks(nproc, script, *args, timeout=timeout).wait()


def together(*sessions: Sequence) -> List[str]:
    """Independent sessions, each ``(nproc, script, *args)``, started at once and waited for in
    order: two sessions' ranks keep 2 cores busier than one's, whose wall time is largely start-up
    (each rank imports torch and megatron-core) and collectives' latency. Their stdouts in order;
    the first failure is raised, and the sessions still running are stopped."""
    started: List[Ranks] = []
    try:
        for nproc, script, *args in sessions:
            started.append(Ranks(nproc, script, *args))
        return [ranks.wait() for ranks in started]
    finally:
        for ranks in started:
            ranks.close()  # again after a wait: nothing left to do
