"""A fork server for the tests' ranks: one interpreter that has imported torch, Megatron and
megarl's engines once, and forks a rank for each request, so that a rank starts with its imports
done (``launch.torchrun``).

Why: a rank of a test spends 4-6 CPU-s importing torch, megatron-core, transformers and megarl
before it computes anything, and the suite starts a couple of hundred of them on 2 cores. Forked
from this process, a rank is still its own process, with its own environment, working
directory, standard streams, process groups and exit code; it runs the script as
``python -u script.py args`` would (``__main__``, ``sys.argv``, ``sys.path[0]``), and exits
through the interpreter's own shutdown (threads joined, ``atexit``, finalization). What it shares
with its siblings is the imported modules' pages, copy-on-write.

The server is single-threaded (a fork copies only the calling thread) and runs no tensor
operation before it forks, so no OpenMP pool exists to be copied half alive. It freezes its
imports' objects (``gc.freeze``) before it forks, as ``megarl.runtime.settle_collector`` does in a
rank started anew: no rank's collection walks them (a probe rank took ~1 s to exit without it). Requests come over
a Unix socket: a JSON line (argv, env, cwd, the paths of stdout and stderr) with at most one file
descriptor beside it (rank 0's store socket, ``MEGARL_STORE_FD``). The server answers the rank's
pid, then its exit status (``subprocess``'s convention: ``-N`` for signal ``N``) when it ends.
It exits when its standard input closes (the test process is gone), killing the ranks it still
has, so that nothing outlives the suite.

Environment variables read when a library is imported (``PYTHON*``, ``OMP_*``, ``MKL_*``,
``LD_*``, ``KMP_*``, ``GOMP_*`` and ``TORCH_*``) must equal the server's own: the
launcher starts a new server, with the rank's environment, where they do not (:func:`forkable`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys

PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "torch.optim", "safetensors.torch", "transformers",
           "megarl.engines.megatron_engine", "megarl.engines.supervised", "megarl.models",
           "megarl.checkpoint.dist_ckpt", "megatron.core.dist_checkpointing", "megarl.controller.rl_worker")
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "LD_", "KMP_", "GOMP_", "TORCH_")
READ_LATER = ("TORCH_GLOO_LAZY_INIT",)  # of those prefixes, read when a process group is built
MAX_REQUEST = 1 << 20
MAX_FDS = 3


def import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in READ_LATER}


def forkable(env: dict, server_env: dict) -> bool:
    """Whether a rank with ``env`` may be forked from a server started with ``server_env``."""
    return import_time_env(env) == import_time_env(server_env)


def _receive(conn: socket.socket):
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, MAX_FDS)
    while not data.endswith(b"\n"):
        more = conn.recv(MAX_REQUEST)
        if not more:
            raise ConnectionError("the request ended early")
        data += more
    return json.loads(data), fds


def serve(path: str):
    """Answer requests until standard input closes; return a request's job in its forked child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    ranks = {}  # pid -> the connection to answer
    while True:
        for key, _ in sel.select(timeout=0.05):
            if isinstance(key.data, int):  # a bound child's requester: any byte or its end ends the child
                sel.unregister(key.fileobj)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.data, signal.SIGKILL)
                continue
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in ranks:
                        os.kill(pid, signal.SIGKILL)
                    return None
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (ConnectionError, ValueError, OSError) as error:
                conn.close()
                sys.stderr.write(f"zygote: a bad request: {error}\n")
                continue
            if request.get("check_env") and not forkable(request["env"], dict(os.environ)):
                differ = sorted(set(import_time_env(request["env"]).items()) ^ set(import_time_env(os.environ).items()))
                keys = sorted({k for k, _ in differ})
                sys.stderr.write(f"zygote: not forked, another import-time environment: {keys}\n")
                conn.sendall(json.dumps({"refused": keys}).encode() + b"\n")
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for other in [conn, *ranks.values()]:  # its siblings' connections are not its own
                    other.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            ranks[pid] = conn
            if request.get("bound"):  # the child lives as long as the connection of its requester
                sel.register(conn, selectors.EVENT_READ, pid)
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = ranks.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(KeyError):
                    sel.unregister(conn)
                with contextlib.suppress(OSError):  # the launcher stopped waiting (its test ended)
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                conn.close()


def become(request: dict, fds) -> None:
    """In the forked child: take the request's environment, directory and streams, as a new
    interpreter started for it would have them."""
    env = dict(request["env"])
    os.chdir(request["cwd"])
    if request.get("own_group"):  # as the raylet starts a worker: a process group of its own
        os.setpgid(0, 0)
    if request.get("stdio_fds"):  # the requester's own standard streams
        for fd, received in enumerate(fds):
            os.dup2(received, fd)
            os.close(received)
    else:
        env_fd = request.get("fd_env")
        if fds:
            env[env_fd] = str(fds[0])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, closefd=False)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))


def main() -> None:
    import importlib

    for name in (*PRELOAD, *sys.argv[2:]):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the imports' objects: out of every rank's collections, and its pages not written by them
    job = serve(sys.argv[1])
    if job is None:
        return
    request, fds = job
    become(request, fds)
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
