"""Every process of a run carries a tag, so that none outlives it: the driver, Ray's private
cluster, the workers, their forked checkpoint writers and the reward workers.

The tag is the environment variable ``MEGARL_RUN_ID=<uuid>``: children inherit it (Ray's
processes from the driver that starts them, workers also through their ``runtime_env``), and
``/proc/<pid>/environ`` shows it. A watchdog process outside the run kills what is left when the
driver ends, even by SIGKILL, when nothing in the driver can run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import List, Optional

RUN_TAG = "MEGARL_RUN_ID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerDied(RuntimeError):
    """A rank's process or node is gone; the run cannot continue (it resumes from a checkpoint).
    ``megarl train`` exits with code 3."""


class WorkerHung(WorkerDied):
    """A rank made no progress for ``trainer.hang_timeout_s``; the run is stopped as for a dead
    rank (exit 3) and resumes from its newest checkpoint."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def tagged_pids(value: str, name: str = RUN_TAG) -> List[int]:
    """PIDs of this user's processes whose environment holds ``name=value`` (not this process)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or another user's
            continue
    return found


def descendants(*pids: int) -> List[int]:
    """Live descendants of ``pids`` (Ray's agents lose our tag: they rewrite their environment
    block with their process title, so a run also knows its processes by ancestry); one pass
    over /proc whatever their number."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat and stat[0] != "Z":
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_processes(run_id: str) -> set:
    """Identities of the run's processes: the tagged ones and their descendants (the watchdog
    asks every second: two passes over /proc)."""
    tagged = tagged_pids(run_id)
    return {identity(p) for p in [*tagged, *descendants(*tagged)]} - {None}


def identity(pid: int):
    """(pid, start time): a PID reused by an unrelated process later does not match."""
    stat = _stat(pid)
    return (pid, stat[19]) if stat else None


def kill_tagged(value: str, name: str = RUN_TAG, grace_s: float = 0.0, also=()) -> List[int]:
    """SIGKILL every process tagged ``name=value``, and those of ``also`` (identities) still the
    same process, alive after ``grace_s`` seconds (they may be exiting on their own); returns the
    PIDs killed."""
    deadline = time.monotonic() + grace_s
    while True:
        found = {identity(p) for p in tagged_pids(value, name)} | {i for i in also if identity(i[0]) == i}
        found = [i for i in found if i is not None and not exited(i[0]) and i[0] != os.getpid()]
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return [i[0] for i in found if kill_exactly(i)]


def kill_exactly(ident) -> bool:
    """SIGKILL the process of identity ``ident`` (:func:`identity`), and no other: the PID is
    pinned (a pidfd) before the identity is checked again, so a process that exited and whose
    PID went to another in between is never signalled. Whether it was signalled."""
    try:
        fd = os.pidfd_open(ident[0])
    except (ProcessLookupError, OSError):  # gone
        return False
    try:
        if identity(ident[0]) != ident:  # the number belongs to another process now
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:  # exited meanwhile
        return False
    finally:
        os.close(fd)


def _stat(pid: int):
    """The fields of /proc/<pid>/stat after the command name: state, ppid, ...; None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def exited(pid: int) -> bool:
    """Whether process ``pid`` has exited: gone, or a zombie its parent has not reaped."""
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X")


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the thread that forked it exits (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def forks_die_with_this_process() -> None:
    """Processes this one forks from now on (megatron's async checkpoint writer, multiprocessing
    helpers) die with it, instead of living on as orphans when a worker is killed. Idempotent."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=die_with_parent)
        _fork_hook_installed = True


_fork_hook_installed = False


# A Ctrl-C that the driver has not taken this long after it arrived (see
# megarl.runtime.signals.InterruptNotice) finds its main thread stuck in a native call. A driver
# that can take one does so within about a second (its waits on the ranks return to Python at least
# once a second) and has exited 2-5 s later.
WEDGED_S = 10.0


def start_watchdog(run_id: str, notify_fd: Optional[int] = None, wedged_s: float = WEDGED_S) -> subprocess.Popen:
    """A process that waits for this one to end (however it ends), then kills the run's
    leftovers. It runs in its own session without the run's tag, so neither a Ctrl-C nor the
    cleanup kills it. ``notify_fd``: the read end of this process's
    :class:`~megarl.runtime.signals.InterruptNotice`: a Ctrl-C that this process has not taken
    within ``wedged_s`` stops the run's processes, then this one."""
    env = {k: v for k, v in os.environ.items() if k != RUN_TAG}
    args = [str(os.getpid()), run_id] + ([str(notify_fd), str(wedged_s)] if notify_fd is not None else [])
    return subprocess.Popen([sys.executable, "-m", "megarl.runtime.processes", *args], env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            pass_fds=(notify_fd,) if notify_fd is not None else ())


def _watch(pid: int, run_id: str, notify_fd: Optional[int] = None, wedged_s: float = WEDGED_S) -> None:
    """Until ``pid`` ends, note the run's processes every second (Ray's agents are untagged), and
    read ``notify_fd`` (signal numbers, and :data:`~megarl.runtime.signals.TAKEN` when the driver
    took a SIGINT); then kill what is left of them and of the tagged processes."""
    from megarl.runtime.signals import TAKEN

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    known = set()
    interrupted_at = None  # an untaken Ctrl-C's arrival
    while fd is not None:
        ready = select.select([fd] if notify_fd is None else [fd, notify_fd], [], [], 1.0)[0]
        if fd in ready:  # readable once it has exited
            break
        if notify_fd is not None and notify_fd in ready:
            data = os.read(notify_fd, 512)
            if not data:  # the driver closed it: its main thread is in its orderly cleanup
                notify_fd = interrupted_at = None
            for byte in data:
                if byte == signal.SIGINT and interrupted_at is None:
                    interrupted_at = time.monotonic()
                elif byte == TAKEN:
                    interrupted_at = None
        known |= run_processes(run_id)
        if interrupted_at is not None and time.monotonic() - interrupted_at >= wedged_s:
            _stop_wedged(pid, fd, run_id, known, wedged_s)
            interrupted_at = notify_fd = None
    # the driver's own cleanup (or Ray's) may still be finishing: give it a moment
    killed = kill_tagged(run_id, grace_s=3.0, also=known)
    if killed:
        print(f"megarl: killed {len(killed)} process(es) left by run {run_id}: {killed}", file=sys.stderr,
              flush=True)


def _stop_wedged(pid: int, pidfd: int, run_id: str, known: set, wedged_s: float) -> None:
    """The driver has not taken a Ctrl-C: stop the run's processes (a driver stuck waiting on one of
    them is freed, takes the Ctrl-C and exits 130 itself); a driver still there after half as long
    again is killed."""
    print(f"megarl: Ctrl-C not taken by the driver (pid {pid}) within {wedged_s:g} s: its main thread is "
          f"stuck in a native call; stopping the run's processes", file=sys.stderr, flush=True)
    kill_tagged(run_id, also=known)
    if not select.select([pidfd], [], [], wedged_s / 2)[0]:
        print(f"megarl: the driver (pid {pid}) is still stuck: killed", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # the driver itself, even if its PID was reused


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2], *([int(sys.argv[3]), float(sys.argv[4])] if len(sys.argv) > 3 else []))
