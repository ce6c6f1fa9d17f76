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
        procs = []
        for rank in range(nproc):
            env, fds = dict(base, RANK=str(rank), LOCAL_RANK=str(rank)), ()
            if rank == 0:
                env[STORE_FD_ENV], fds = str(server.fileno()), (server.fileno(),)
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
