"""One run per run directory: the driver holds an exclusive lock on ``RUN_DIR/.lock`` for the
run's life (the kernel releases it when the driver dies, so a crash leaves no stale lock)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from megarl.config import ConfigError


T = TypeVar("T")


class RunDirInUse(ConfigError):
    """Another run holds the run directory."""


@contextlib.contextmanager
def lock_run_dir(run_dir: str) -> Iterator[None]:
    """Hold ``run_dir``'s lock, or raise :class:`RunDirInUse` having written nothing there."""
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    lock = path / ".lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            raise RunDirInUse(f"trainer.run_dir={run_dir} is in use by another run (pid {holder} holds {lock}); "
                              f"wait for it to end or choose another trainer.run_dir") from None
        os.ftruncate(fd, 0)  # the holder's pid, for the message above
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def run_locked(run_dir: str, train: Callable[[], T]) -> T:
    """``train()`` holding ``run_dir``'s lock from before Ray starts to the end (a second run on the
    directory refuses, RunDirInUse, having written nothing); a run that raises, or is interrupted,
    is marked FAILED, or KILLED, in its trackers (MLflow, wandb, SwanLab)."""
    from megarl.trainer.logger import end_unfinished_runs

    with lock_run_dir(run_dir):
        try:
            return train()
        except BaseException as err:
            end_unfinished_runs(err)
            raise
