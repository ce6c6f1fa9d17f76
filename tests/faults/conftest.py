"""The fault suite's harness: every process a test module starts carries a tag, and after each
case none of them may be alive.

The tag is ``MEGARL_TEST_CASE=<uuid>`` in this process's environment (one value per module, so a
module-scoped run is tagged too); children inherit it through exec, Ray's processes from the
driver, forks from their parent. Ray's agents overwrite their environment block with their
process title, so pytest is also made a child subreaper: an orphan of the case is re-parented
here and shows as a descendant. After each case the fixture waits up to ``SURVIVOR_WAIT_S`` for
tagged processes and descendants to end, then kills those left and fails the case, naming them.
Descendants alive before the module began are not its own: a pytest-xdist worker runs other
test files before this one, and what they left running (a reward pool's workers, say) belongs to
them.
"""

from __future__ import annotations

import ctypes
import os
import time
import uuid

import pytest

from megarl.runtime.processes import descendants, identity, kill_tagged, tagged_pids

TAG = "MEGARL_TEST_CASE"
SURVIVOR_WAIT_S = 15.0  # a run's own cleanup (and its watchdog's 3 s grace) ends well within this
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _subreaper(on: bool) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


@pytest.fixture(scope="module", autouse=True)
def process_tag():
    """The module's tag, and pytest as a subreaper while the module runs (only then: orphans of
    the rest of the suite go to init as usual, instead of waiting here as zombies)."""
    value, previous = uuid.uuid4().hex, os.environ.get(TAG)
    os.environ[TAG] = value
    _before.clear()
    _before.update(identity(pid) for pid in descendants(os.getpid()))
    _subreaper(True)
    yield value
    _reap_zombie_children()
    _subreaper(False)
    if previous is None:
        os.environ.pop(TAG, None)
    else:
        os.environ[TAG] = previous


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid} {cmdline[:120]}"
    except OSError:
        return f"{pid} (gone)"


_before: set = set()  # identities (pid, start time) of descendants alive when the module began


def survivors(tag: str) -> set:
    _reap_zombie_children()
    return set(tagged_pids(tag, TAG)) | {pid for pid in descendants(os.getpid()) if identity(pid) not in _before}


def _reap_zombie_children() -> None:
    """Orphans re-parented here that have exited (the case's Popen objects are done with theirs)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@pytest.fixture(autouse=True)
def no_process_survives(process_tag):
    yield
    deadline = time.monotonic() + SURVIVOR_WAIT_S
    while survivors(process_tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = survivors(process_tag)
    names = [describe(pid) for pid in sorted(left)]
    kill_tagged(process_tag, TAG, also={identity(p) for p in left} - {None})
    if left:
        pytest.fail(f"{len(left)} process(es) of this case outlived it by {SURVIVOR_WAIT_S:.0f}s:\n"
                    + "\n".join(names), pytrace=False)
