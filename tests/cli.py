"""The ``megarl`` command of the end-to-end tests, two ways:

* :func:`megarl`: as a user types it, a new interpreter (``python -m megarl.cli``), from ``cwd``;
* :class:`Started`: :func:`megarl`'s new interpreter in the background, waited for later;
* :func:`megarl_here`: the same CLI ``main`` with the test process as the driver, from ``cwd``:
  the command line, its exit codes and the teardown of whatever it started are the CLI's own,
  without a new interpreter's start-up and imports (3-4 s a command here, 8-12 s of a short
  ``megarl train`` run's wall time on 2 cores). Its output is captured, and echoed.

A ``train``, ``sft``, ``train-rm``, ``dpo`` or ``eval`` command joins the suite's shared Ray
cluster either way (:func:`tests.ray_cluster.joined`).
Runs whose subject is the process itself (a signal, a kill, the exit of a new interpreter) use
:func:`megarl`.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from tests.ray_cluster import joined

ROOT = Path(__file__).resolve().parents[1]


def megarl(*args: str, cwd: Path, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    extra = joined(args)
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args, *extra], cwd=cwd, env=_environ(env),
                          capture_output=True, text=True, timeout=timeout)


def _environ(env: dict) -> dict:
    """A ``megarl`` command's environment. Taken after :func:`joined`, which may start the shared
    cluster and with it set the suite's ``RAY_RUNTIME_ENV_HOOK`` (:mod:`megarl.testing.ray_fork`)."""
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **env)


class Started:
    """A ``megarl`` command started in the background as a new interpreter (as :func:`megarl`
    runs it), its output in files under ``cwd``: a test starts a run, runs others beside it (two
    runs' ranks keep 2 cores busier than one's, whose wall time is largely start-up and
    collectives' latency), then :meth:`wait` s for it. :meth:`stop` (Ctrl-C, the CLI's own
    teardown) ends it if no test waited: use it in a fixture's ``finally``. Its output goes to
    ``out`` (default ``cwd``)."""

    def __init__(self, *args: str, cwd: Path, out: Optional[Path] = None, **env: str):
        extra = joined(args)
        environ = _environ(env)
        self.args, self.cwd = args, Path(cwd)
        Path(out or cwd).mkdir(parents=True, exist_ok=True)
        self.out, self.err = Path(out or cwd) / "megarl.stdout", Path(out or cwd) / "megarl.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", *args, *extra], cwd=cwd,
                                         env=environ, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def wait(self, timeout: int = 900) -> subprocess.CompletedProcess:
        code = self.proc.wait(timeout=timeout)
        return subprocess.CompletedProcess(["megarl", *self.args], code, self.out.read_text(), self.err.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=300)


class _Tee(io.StringIO):
    def __init__(self, echo):
        super().__init__()
        self.echo = echo

    def write(self, text):
        self.echo.write(text)
        return super().write(text)


def megarl_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The test process is left as it was: its directory, its environment (a command sets the
    process group's MASTER_ADDR, WORLD_SIZE, RANK...: inherited by later tests' subprocesses, a
    ``train-lm`` saw a world of 1 and Ctrl-C tests hung), its signal handlers and its garbage
    collector."""
    import gc

    from megarl.cli import main

    here, out, err = os.getcwd(), _Tee(sys.stdout), _Tee(sys.stderr)
    environ = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*args, *joined(args)])
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        for s, handler in handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        gc.unfreeze()  # the CLI freezes its objects for its own exit
    return subprocess.CompletedProcess(["megarl", *args], code, out.getvalue(), err.getvalue())
