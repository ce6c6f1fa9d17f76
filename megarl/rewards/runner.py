"""Scoring a batch safely in worker processes: a reward function that raises, returns a
non-number, NaN or inf, runs past its time limit or allocates past its memory ceiling on one
sample gives that sample 0, is counted, and never stops the run; a hanging function's worker, and
one out of memory, is killed and replaced."""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Counter, Dict, List, Optional, Sequence

from megarl.rewards.worker import read_frame, write_frame

log = logging.getLogger(__name__)
KILL_WAIT_S = 30.0  # how long a SIGKILLed worker may take to be reaped


@dataclass
class RewardSample:
    response: str
    answer: Any
    prompt: Any = None  # the record's prompt: a string or chat messages
    extra: Dict[str, Any] = field(default_factory=dict)  # the record's other fields


@dataclass
class ScoreReport:
    scores: List[float]
    failures: Counter = field(default_factory=collections.Counter)  # kind -> samples; timeouts apart
    timeouts: int = 0
    examples: Dict[str, str] = field(default_factory=dict)  # kind -> the first such sample
    failed_rows: set = field(default_factory=set)  # the samples that failed or timed out

    @property
    def failed(self) -> int:
        return sum(self.failures.values())


class _Worker:
    """One process; ``index`` is the sample it runs (None when idle), ``deadline`` when it must
    answer (its start-up, or its sample's limit)."""

    def __init__(self, fn_path: str, start_timeout_s: float, memory_mb: int = 0):
        # The worker sees the driver's import path (tests, a user's package run from its folder),
        # and gets its own process group so that a kill also ends whatever the function started.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self.proc = subprocess.Popen([sys.executable, "-c", "from megarl.rewards.worker import main; main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.fd = self.proc.stdout.fileno()
        self.ready = False
        self.start_s: Optional[float] = None  # seconds from spawn to loaded function
        self.index: Optional[int] = None
        self.started = time.monotonic()
        self.deadline = self.started + start_timeout_s
        write_frame(self.proc.stdin.fileno(), (fn_path, memory_mb))

    def kill(self) -> int:
        """Kill the worker's process group and reap the worker; its exit code. The group is
        signalled only while the worker is unreaped: its PID, the group's ID, is then still its own
        (once reaped, a new process may be given that number, and be a group leader)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            code = self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"reward worker pid {self.proc.pid} still exists {KILL_WAIT_S:.0f}s after SIGKILL "
                               f"(stuck in the kernel: a hung file system?)") from None
        self.proc.stdin.close()
        self.proc.stdout.close()
        return code


class RewardPool:
    """``workers`` processes that score samples with the function at ``fn_path``
    (``module:function``). Each sample's ``timeout_s`` runs from its own start in a worker, so
    samples queued behind slow ones are never charged for the wait. Start it once per run (a
    process start costs tens of ms) and :meth:`close` it at the end."""

    def __init__(self, fn_path: str, workers: int, timeout_s: float, start_timeout_s: float = 60.0,
                 memory_mb: int = 0):
        self.fn_path, self.timeout_s, self.start_timeout_s = fn_path, timeout_s, start_timeout_s
        self.memory_mb = memory_mb  # address space a worker may add while scoring (0 = no ceiling)
        self.workers = [_Worker(fn_path, start_timeout_s, memory_mb) for _ in range(workers)]
        self.logged: set = set()  # failure kinds already logged (once each per run)
        atexit.register(self.close)  # no worker outlives the driver, whatever path it exits by

    def score(self, samples: Sequence[RewardSample]) -> ScoreReport:
        assert self.workers, "the reward pool is closed"
        report = ScoreReport(scores=[0.0] * len(samples))
        queue = collections.deque(range(len(samples)))

        def fail(index: int, kind: str, message: str) -> None:
            report.failed_rows.add(index)
            if kind == "timeout":
                report.timeouts += 1
            else:
                report.failures[kind] += 1
            report.examples.setdefault(kind, f"sample {index}: {message}")

        while queue or any(w.index is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.index is None and queue:
                    self._dispatch(w, queue, samples)
            busy = [w for w in self.workers if w.index is not None or not w.ready]
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            readable = set(wait([w.fd for w in busy], timeout))
            for w in busy:
                if w.fd not in readable:
                    continue
                message = read_frame(w.fd)
                if not w.ready:
                    self._started(w, message)
                elif message is None:  # the function killed its process (os._exit, a crash)
                    index = w.index
                    code = self._replace(w)  # reaped only after its group is killed (see _Worker.kill)
                    fail(index, "crashed", f"the worker process died (exit code {code})")
                else:
                    index, kind, result, seconds = message
                    w.index = None
                    if seconds > self.timeout_s:  # came back, but past the limit
                        fail(index, "timeout", f"took {seconds:.2f}s > algorithm.reward_timeout_s={self.timeout_s}")
                    elif kind == "ok":
                        report.scores[index] = result
                    else:
                        fail(index, kind, result)
                    if kind == "memory":  # the worker exits after its MemoryError
                        self._replace(w)
            now = time.monotonic()
            for w in list(self.workers):
                if w.index is not None and now >= w.deadline:  # hung or slow: kill it, score 0
                    fail(w.index, "timeout", f"killed after {self.timeout_s}s (algorithm.reward_timeout_s)")
                    self._replace(w)
                elif not w.ready and now >= w.deadline:
                    raise RuntimeError(f"a reward worker for '{self.fn_path}' did not start within "
                                       f"{self.start_timeout_s}s")
        self._log(report)
        return report

    def _dispatch(self, w: _Worker, queue, samples: Sequence[RewardSample]) -> None:
        index = queue.popleft()
        s = samples[index]
        try:
            write_frame(w.proc.stdin.fileno(), (index, s.response, s.answer, {"prompt": s.prompt, "extra": s.extra}))
        except BrokenPipeError:  # the process died between samples: not this sample's fault
            queue.appendleft(index)
            self._replace(w)
            return
        w.index, w.deadline = index, time.monotonic() + self.timeout_s

    def _started(self, w: _Worker, message) -> None:
        if message is None or message[0] != "ready":
            why = message[1] if message else f"it exited with code {w.kill()} (its stderr says why)"
            self.close()
            raise ValueError(f"reward function '{self.fn_path}' cannot be loaded in a worker process: {why}")
        w.ready, w.start_s = True, time.monotonic() - w.started

    def _replace(self, w: _Worker) -> int:
        """Kill ``w`` and start another in its place; ``w``'s exit code."""
        code = w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.fn_path, self.start_timeout_s, self.memory_mb)
        return code

    def _log(self, report: ScoreReport) -> None:
        kinds = dict(report.failures, timeout=report.timeouts)
        for kind, count in kinds.items():
            if count and kind not in self.logged:
                self.logged.add(kind)
                log.warning("reward: %d sample(s) of this step scored 0 for '%s' (%s), e.g. %s; counted in "
                            "reward/failures and reward/timeouts each step, not logged again", count, kind,
                            self.fn_path, report.examples[kind])

    def close(self) -> None:
        """Kill every worker (idempotent); a hanging function cannot delay the driver's exit."""
        for w in self.workers:
            if w.proc.returncode is None:
                w.kill()
        self.workers = []
        atexit.unregister(self.close)
