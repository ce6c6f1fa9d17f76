"""How a worker process died, for the error that names it.

Ray reports a rank whose process vanished as ``ActorDiedError: The actor died unexpectedly``,
whatever killed it. Three witnesses on the worker's machine tell the causes apart, and the driver
reads them when the dead rank ran on its own node:

- the worker's stderr (``worker-<id>-<job>-<pid>.err`` in the node's Ray log directory), where
  Python's fault handler (which Ray enables in every worker) writes ``Fatal Python error:
  Segmentation fault`` and the stack of the crashing call;
- Ray's core-worker log (``python-core-worker-<id>_<pid>.log``), where Ray's own signal handler
  writes ``*** SIGSEGV received``;
- the kernel's log (``dmesg``), where the OOM killer writes ``Killed process <pid>``.

A process that left none of them was killed by a signal it cannot catch (SIGKILL) from outside.
Each witness is read with a deadline and its absence is not an error: the message only grows.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from typing import List, Optional

FAULT_LINES = 16  # of the fault handler's report: the error and the innermost frames
TAIL_LINES = 6  # of a stderr without a fault report


def _read_tail(path: str, limit: int = 64 * 1024) -> List[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def stderr_report(logs_dir: str, pid: int) -> Optional[str]:
    """The fault handler's report in the worker's stderr (its first lines), else its last lines."""
    paths = glob.glob(os.path.join(logs_dir, f"worker-*-{pid}.err"))
    if not paths:
        return None
    lines = [line for line in _read_tail(paths[0]) if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if starts:  # the error, then the crashing thread's stack (the report lists every thread's)
        report = lines[starts[-1]:]
        current = next((i for i, line in enumerate(report) if line.startswith("Current thread")), None)
        stack = report[current:] if current is not None else report[1:]
        end = next((i for i, line in enumerate(stack[1:], 1) if not line.startswith(" ")), len(stack))
        picked = [report[0], *stack[:min(end, FAULT_LINES)]]
    else:
        picked = lines[-TAIL_LINES:]
    return f"{paths[0]}:\n    " + "\n    ".join(picked) if picked else None


def caught_signal(logs_dir: str, pid: int) -> Optional[str]:
    """The signal Ray's handler saw in the worker (``SIGSEGV``, ``SIGABRT``, ...), if any."""
    for path in glob.glob(os.path.join(logs_dir, f"python-core-worker-*_{pid}.log")):
        for line in reversed(_read_tail(path)):
            found = re.search(r"\*\*\* (SIG[A-Z]+) received", line)
            if found:
                return found.group(1)
    return None


def kernel_report(pid: int, timeout_s: float = 5.0) -> Optional[str]:
    """The kernel's lines about ``pid`` (an OOM kill, a segfault), if its log is readable here."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pattern = re.compile(rf"(Killed process {pid}\b|\[{pid}\]: segfault|\bpid[= ]{pid}\b)")
    hits = [line.strip() for line in out.splitlines() if pattern.search(line)]
    return "; ".join(hits[-3:]) or None


def explain(pid: int, logs_dir: Optional[str], same_machine: bool) -> str:
    """What the witnesses say about dead worker ``pid``, as text to append to its error ('' when
    the worker ran on another machine, whose logs are there)."""
    if not same_machine:
        return ""
    parts = []
    kernel = kernel_report(pid)
    if kernel:
        parts.append(f"the kernel logged: {kernel}")
    signal_name = caught_signal(logs_dir, pid) if logs_dir else None
    if signal_name:
        parts.append(f"it received {signal_name}")
    stderr = stderr_report(logs_dir, pid) if logs_dir else None
    if stderr and (signal_name or "Fatal Python error" in stderr):
        parts.append(f"its fault report in {stderr}")
    elif stderr:
        parts.append(f"the end of its stderr, {stderr}")
    if not kernel and not signal_name and glob.glob(os.path.join(logs_dir or "", f"worker-*-{pid}.err")):
        parts.append("no crash was recorded: a signal it cannot catch (SIGKILL) from another process, "
                     "or an OOM kill the kernel log here does not show")
    return "; ".join(parts)
