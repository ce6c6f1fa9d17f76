"""The rollout side of the asynchronous loop: batches drawn ahead of the trainer.

Under split placement a driver thread draws (generates and scores) batch after batch while the
trainer trains, as far ahead as the staleness bound allows: batch s may be drawn once the rollout
holds policy version s - 1 - bound, so that it is at most ``bound`` versions behind the actor
that trains on it. Generation and weight syncs both run on the rollout's ranks, so one lock keeps
each ``generate`` call and each sync whole (the ranks must see them in the same order). Under
colocated placement there is no second set of ranks to overlap with: batch s + 1 is drawn when
step s begins, in line.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from megarl.trainer.steps import Sampled

READY_POLL_S = 1.0  # how often a trainer waiting for a batch checks that the drawing thread lives


class Timer:
    """``phase(name)`` for one draw: seconds per phase of that draw alone."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    def phase(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.start

        return _Phase()


class LockedRollout:
    """The rollout role with each ``generate`` call under the producer's lock. A call that fails
    records its error on the producer before the lock is released, so that a weight sync waiting
    for the lock sees the failure instead of starting a collective with broken ranks."""

    def __init__(self, producer: "Producer"):
        self.producer = producer

    def generate(self, prompts, sampling):
        with self.producer.lock:
            try:
                return self.producer.rollout.generate(prompts, sampling)
            except BaseException as err:
                self.producer.failed = err
                raise


class PartialRollout:
    """The rollout role for partial rollouts (``parallel.rollout.partial_rollout``): a ``generate``
    call begins its responses and advances them ``chunk`` tokens at a time, each call under the
    producer's lock. Between two calls a weight sync that is waiting goes first (the lock alone
    is not fair: this thread would take it back at once); the responses then continue under the
    new weights, their tokens carrying the version that sampled each."""

    def __init__(self, producer: "Producer", chunk: int):
        self.producer, self.chunk = producer, chunk

    def generate(self, prompts, sampling):
        p = self.producer
        self._call(p.rollout.begin, prompts, sampling)
        out, left = [], 1
        while left:
            p.yield_to_sync()
            done, left = self._call(p.rollout.advance, self.chunk)
            out += done
        return sorted(out, key=lambda r: (r.prompt_index, r.sample_index))

    def _call(self, fn, *args):
        with self.producer.lock:
            try:
                return fn(*args)
            except BaseException as err:
                self.producer.failed = err
                raise


class Producer:
    """Batches for steps ``start`` .. ``last``; :meth:`take` hands them out in order.

    ``draw(step, rollout, phase)`` draws one batch (``sample_step``). ``threaded``: a driver
    thread draws ahead (split placement); else each :meth:`take` draws the next batch in line.
    ``chunk``: partial rollouts (:class:`PartialRollout`), a sync coming in between chunks.
    """

    def __init__(self, draw: Callable, rollout, start: int, last: int, bound: int, threaded: bool,
                 chunk: Optional[int] = None, deadline_s: float = 1800.0):
        self.draw, self.rollout, self.last, self.bound = draw, rollout, last, bound
        self.deadline_s = deadline_s  # trainer.hang_timeout_s: the longest a chunk waits for a weight sync
        self.chunk = chunk  # partial rollouts: tokens per call between two points where a sync may come in
        self.lock = threading.Lock()
        self.version = start - 1  # the rollout's policy version
        self.changed = threading.Condition()
        self.ready: "queue.Queue[Tuple[int, object, Dict[str, float]]]" = queue.Queue()
        self.stopped = False
        self.failed: Optional[BaseException] = None  # the drawing thread's error: no sync after it
        self.next_step = start
        self.syncs_waiting = 0  # weight syncs waiting for the lock (PartialRollout lets them in)
        if threaded:
            self.thread = threading.Thread(target=self._run, name="megarl-rollout-producer", daemon=True)
            self.thread.start()
        else:
            self.thread = None
            self._draw_one()

    def _draw_one(self) -> None:
        step, timer = self.next_step, Timer()
        try:
            rollout = LockedRollout(self) if self.chunk is None else PartialRollout(self, self.chunk)
            self.ready.put((step, self.draw(step, rollout, timer.phase), timer.seconds))
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            self.failed = self.failed or err
            self.ready.put((step, err, {}))
            raise
        self.next_step += 1

    def _run(self) -> None:
        while self.next_step <= self.last:
            with self.changed:
                self.changed.wait_for(lambda: self.stopped or self.version >= self.next_step - 1 - self.bound)
            if self.stopped:
                return
            try:
                self._draw_one()
            except BaseException:  # noqa: BLE001 - already queued for the trainer
                return

    def take(self, step: int) -> Tuple[Sampled, Dict[str, float]]:
        """Batch ``step`` and the seconds of its draw per phase (generate, reward)."""
        got, sampled, seconds = self._next_ready(step)
        if isinstance(sampled, BaseException):
            raise sampled
        assert got == step, (got, step)
        if self.thread is None and self.next_step <= self.last:
            self._draw_one()  # in line: the next batch from the weights before this step's update
        return sampled, seconds

    def _next_ready(self, step: int):
        """The next drawn batch; the drawing thread always hands one over (a batch or its error),
        and each of its waits on the ranks has the run's hang deadline, so this waits only while
        that thread is alive."""
        while True:
            try:
                return self.ready.get(timeout=READY_POLL_S)
            except queue.Empty:
                if self.thread is None or not self.thread.is_alive():
                    if not self.ready.empty():
                        continue
                    raise RuntimeError(f"the rollout's drawing thread ended without handing over the batch of "
                                       f"step {step}") from self.failed

    def sync(self, update: Callable[[], Dict[str, float]], version: int) -> Dict[str, float]:
        """Run a weight sync (``update()``) between generate calls (between two chunks of a partial
        rollout's); the rollout then holds ``version``. After a failed draw (a rollout rank named
        dead or hung while generating) no sync starts: the draw's error is raised here, at once,
        instead of a collective with the broken ranks that would wait out the hang deadline a
        second time."""
        with self.changed:
            self.syncs_waiting += 1
        try:
            self._before_sync()
            with self.lock:
                if self.failed is not None:
                    raise self.failed
                metrics = update()
        finally:
            with self.changed:
                self.syncs_waiting -= 1
                self.changed.notify_all()
        with self.changed:
            self.version = version
            self.changed.notify_all()
        return metrics

    def _before_sync(self) -> None:
        """What a sync waits for once it has announced itself (``syncs_waiting``), before the lock."""

    def yield_to_sync(self) -> None:
        """Wait while a weight sync waits for the lock or runs. The sync is bounded by the run's hang
        deadline on the ranks and always ends (``sync``'s ``finally``); this wait has the same
        deadline of its own, and names what it waited for."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.stopped or not self.syncs_waiting, timeout=self.deadline_s):
                raise TimeoutError(f"partial rollout: a weight sync did not finish within trainer.hang_timeout_s="
                                   f"{self.deadline_s:g}s; the next chunk of generation waited for it")

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()
