"""Running out of disk space, named: :class:`DiskFull` says where, about how many bytes the write
needed and how many are free, and ``megarl`` exits with code 4 on it (``megarl.cli``).

torch's writers seldom say ENOSPC (``unexpected pos 704 vs 598``, ``PytorchStreamWriter failed
writing file``, an errno lost inside a ``CheckpointException``), so a failed write is also
judged by the file system it left behind (:func:`lacks_space`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator, Optional

# An error whose text says this lost its errno on the way (pickled between processes, or
# wrapped by torch's checkpoint writer as a string).
_ENOSPC_TEXT = (os.strerror(errno.ENOSPC), f"[Errno {errno.ENOSPC}]")


class DiskFull(RuntimeError):
    """A write that ran out of disk space. ``needed``: the bytes it needed (an estimate that
    ``what`` describes); ``free``: the bytes free for it; ``failure``: the first line of the
    error the write raised."""

    def __init__(self, message: str, needed: int = 0, what: str = "", free: int = 0, failure: str = ""):
        super().__init__(message)
        self.needed, self.what, self.free, self.failure = needed, what, free, failure


def interrupts(err: BaseException) -> bool:
    """Ctrl-C, an exit or a closing generator: never a failed write. (Any other BaseException
    may be one: torch's ``CheckpointException`` derives from BaseException.)"""
    return isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit))


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged write may still take on the file system of ``path`` (or of its
    nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def used_bytes(path: str | Path) -> int:
    """Disk space the file or the tree at ``path`` takes (allocated blocks); 0 if it is gone."""
    path = Path(path)
    try:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        return sum(p.stat().st_blocks * 512 for p in files)
    except OSError:  # removed meanwhile
        return 0


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and what it wraps: its cause and context, a Ray task error's ``cause``, each
    rank's error in a torch ``CheckpointException`` (``failures``: rank -> (error, traceback))."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
        todo += [e.__cause__, e.__context__, e.__dict__.get("cause"), *inner]


def carries_enospc(err: BaseException) -> bool:
    """ENOSPC anywhere in ``err``: an ``OSError`` with that errno, or its text."""
    return any((isinstance(e, OSError) and e.errno == errno.ENOSPC) or any(t in str(e) for t in _ENOSPC_TEXT)
               for e in _chain(err))


def drop_tracebacks(err: BaseException) -> None:
    """Let go of the frames ``err`` and what it wraps hold: a failed writer among their locals
    keeps its file open, and a removed file's bytes taken, until they go."""
    for e in _chain(err):
        e.__traceback__ = None


def first_line(err: BaseException) -> str:
    """``Type: first line`` of the innermost error a write raised (for a ``CheckpointException``,
    the first rank's)."""
    inner = err
    for e in _chain(err):
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            inner = first[0] if isinstance(first, tuple) else first
            break
    text = (str(inner).strip().splitlines() or [""])[0][:200]
    name = type(inner).__name__
    return text if text.startswith(name) else f"{name}: {text}"


def lacks_space(err: BaseException, path: str | Path, needed: int, written: int = 0) -> bool:
    """Whether the failed write ``err`` under ``path`` failed for lack of space: it carries
    ENOSPC, or the file system could not take it: less free now, counting the ``written`` bytes
    its partial output holds, than it ``needed``, or under 1/64 of it free (the write used the
    disk up; ``needed`` is an estimate and may be low by torch's per-file overhead)."""
    free = free_bytes(path)
    return carries_enospc(err) or free + written < needed or free < needed // 64


def disk_full(path: str | Path, err: BaseException, needed: int, what: str, free: int, note: str = "") -> DiskFull:
    """The :class:`DiskFull` of writing ``path`` that failed with ``err``: ``needed`` bytes
    (``what`` the estimate is), ``free`` bytes free; ``note`` says what was kept or removed."""
    failure = err.failure if isinstance(err, DiskFull) else first_line(err)
    return DiskFull(f"out of disk space writing {path}: it needs about {needed} bytes ({needed / 1e6:.1f} MB; "
                    f"{what}) and {free} bytes ({free / 1e6:.1f} MB) are free there{note} "
                    f"(the write failed with {failure})", needed, what, free, failure)


@contextlib.contextmanager
def named_if_full(path: str | Path, needed: int, what: str, partial: Optional[Path] = None) -> Iterator[None]:
    """Raise a failed write under ``path`` as :class:`DiskFull` when it lacked space
    (:func:`lacks_space`); ``partial``: its output so far (counted as free space, being
    removable). Any other error passes unchanged."""
    try:
        yield
    except DiskFull:
        raise
    except BaseException as err:
        written = used_bytes(partial) if partial is not None else 0
        if interrupts(err) or not lacks_space(err, path, needed, written):
            raise
        raise disk_full(path, err, needed, what, free_bytes(path) + written) from err


def call_named_if_full(fn, path: str | Path, needed: int, what: str, partial: Optional[Path] = None):
    """``fn()`` under :func:`named_if_full` (for a callback run later, an async save's finalize)."""
    with named_if_full(path, needed, what, partial):
        return fn()


def append_text(path: Path, text: str, what: str) -> None:
    """Append ``text`` to ``path``; when that fails the file is cut back to its former length,
    so no partial line stays (:class:`DiskFull` when for lack of space)."""
    size = path.stat().st_size if path.exists() else 0
    data = text.encode()
    try:
        with path.open("ab") as f:
            f.write(data)
    except BaseException as err:
        with contextlib.suppress(OSError), path.open("r+b") as f:
            f.truncate(size)
        if not interrupts(err) and lacks_space(err, path, len(data)):
            raise disk_full(path, err, len(data), what, free_bytes(path)) from err
        raise


def replace_text(path: Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` as :func:`replace_bytes` does."""
    replace_bytes(path, text.encode(), what)


def replace_bytes(path: Path, data: bytes, what: str) -> None:
    """Write ``data`` to ``path`` through ``path.tmp`` and a rename: ``path`` is either the old
    file or the new one, and a failed write removes the temporary file (:class:`DiskFull` when
    for lack of space)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with named_if_full(path, len(data), what, partial=tmp):
            tmp.write_bytes(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
