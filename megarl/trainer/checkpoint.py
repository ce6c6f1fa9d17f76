"""Run checkpoints: every role's training state (Megatron dist checkpoints written by the
workers), the driver's state (step, data position) and the config snapshot.

Atomic: a checkpoint is written into ``step_N.tmp``, listed in a manifest (every file's size and
SHA-256), renamed to ``step_N``, and only then named by the ``latest`` pointer (itself replaced
atomically). A directory still ending in ``.tmp`` is never used. On resume a checkpoint whose
files do not match its manifest, or whose dist-checkpoint metadata the allow-list refuses, is
reported (naming the file) and the one before it is used; ``export-hf`` refuses it instead.
The last ``keep`` stay.

A save that fails removes its ``step_N.tmp``, leaving the previous checkpoint and ``latest`` as
they were; one that ran out of space is a :class:`~megarl.checkpoint.disk.DiskFull` naming the
checkpoint, the bytes it needed (the workers' estimate: the tensors they write; else the size of
the previous checkpoint) and the bytes free, and a rerun resumes from the previous checkpoint
once there is space.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megarl.checkpoint.disk import (
    DiskFull, disk_full, drop_tracebacks, free_bytes, interrupts, lacks_space, used_bytes,
)
from megarl.checkpoint.hf_io import CheckpointFileError
from megarl.checkpoint.integrity import load_dist_metadata, verify_manifest, write_manifest

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


class Checkpoints:
    def __init__(self, run_dir, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, step: int, write_roles, driver_state: Dict, config_yaml: str) -> Path:
        """``write_roles(tmp_dir)`` writes the workers' parts (collective)."""
        return self.commit(self.begin(step, write_roles, driver_state, config_yaml))

    def begin(self, step: int, write_roles, driver_state: Dict, config_yaml: str) -> Path:
        """Write into ``step_N.tmp``; the workers' parts may still be in flight (async save).
        Any ``.tmp`` left by a run that was killed is removed first: no other save is in flight
        when one begins."""
        tmp = self.root / f"step_{step:06d}.tmp"
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            write_roles(tmp)
            torch.save(driver_state, tmp / "driver.pt")
            (tmp / "config.yaml").write_text(config_yaml)
        except BaseException as err:
            self._failed(tmp, err)
            raise
        return tmp

    def finished(self, tmp: Path, finish) -> bool:
        """``finish()``: the workers' finalize of the async save into ``tmp``, True once every
        part is written. A failure there is handled as in :meth:`begin`."""
        try:
            return finish()
        except BaseException as err:
            self._failed(tmp, err)
            raise

    def commit(self, tmp: Path) -> Path:
        """Once every part of ``tmp`` is on disk: manifest, rename, ``latest``, keep-k."""
        final = tmp.with_name(tmp.name[: -len(".tmp")])
        pointer = self.root / "latest.tmp"
        try:  # everything that takes space, before anything is renamed
            # Once every worker's file is complete (async saves included): the workers hashed
            # their own files in parallel as they wrote them (save_train_state); this merges
            # their digests and hashes the rest (driver.pt, config.yaml, an async save's
            # .metadata) here.
            write_manifest(tmp)
            pointer.write_text(final.name)
        except BaseException as err:
            self._failed(tmp, err)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        os.replace(pointer, self.root / "latest")
        for old in self.complete()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _failed(self, tmp: Path, err: BaseException) -> None:
        """After a save into ``tmp`` failed with ``err``: remove ``tmp`` (and a ``latest.tmp``);
        raise :class:`DiskFull` if it was for lack of space, else return (the caller re-raises).
        An interrupt leaves ``tmp`` to the next :meth:`begin` (workers may still write into it)."""
        if interrupts(err):
            return
        cause = err.__dict__.get("cause", err)  # a worker's error, as Ray delivers it
        if isinstance(cause, DiskFull):  # named by the workers, who know what they were writing
            needed, what, full = cause.needed, cause.what, True
        else:
            previous = next(iter(self.complete()), None)
            needed, what = ((used_bytes(previous), f"the size of the previous checkpoint {previous.name}")
                            if previous else (used_bytes(tmp), "at least what the save had written"))
            full = lacks_space(cause, self.root, needed, used_bytes(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
        (self.root / "latest.tmp").unlink(missing_ok=True)
        if not full:
            return
        drop_tracebacks(err)  # before measuring what is free: a failed writer in them holds its file open
        kept = self.newest()
        note = f" after removing the partial {tmp.name}" + (
            f"; latest still names {kept.name}: free space, then rerun to resume from it" if kept else "")
        raise disk_full(tmp.with_name(tmp.name[: -len(".tmp")]), cause, needed, what, free_bytes(self.root),
                        note) from None

    def complete(self) -> List[Path]:
        """Finished checkpoints, newest first (``.tmp`` leftovers excluded)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                      key=lambda p: p.name, reverse=True)

    @staticmethod
    def verify(path: Path) -> None:
        """Raise :class:`CheckpointFileError` naming the first file of ``path`` that differs
        from the manifest, or a dist checkpoint whose metadata the allow-list refuses."""
        verify_manifest(path)
        for metadata in sorted(path.rglob(".metadata")):
            load_dist_metadata(metadata.parent)

    def newest(self) -> Optional[Path]:
        """The checkpoint ``latest`` names (else the newest complete one), unverified."""
        pointer = self.root / "latest"
        if pointer.is_file():
            return self.root / pointer.read_text().strip()
        complete = self.complete()
        return complete[0] if complete else None

    def latest(self) -> Optional[Tuple[Path, Dict]]:
        """The newest usable checkpoint and its driver state, or None; unusable ones are
        reported (``latest`` first, then older ones)."""
        named = self.newest()
        candidates = ([named] if named else []) + [c for c in self.complete() if c != named]
        for path in candidates:
            try:
                if not path.is_dir():
                    raise CheckpointError(f"{path}: named by 'latest' but missing")
                self.verify(path)
                return path, torch.load(path / "driver.pt", weights_only=True)
            except (CheckpointError, CheckpointFileError, RuntimeError, OSError) as err:
                log.warning("checkpoint not usable, trying the previous one: %s", err)
                print(f"megarl: checkpoint not usable, trying the previous one: {err}", flush=True)
        return None


class CheckpointSchedule:
    """When a run saves: every ``trainer.save_interval`` steps and at the last one, and after the
    step a SIGTERM arrived in (``preemption``, megarl.runtime.signals.Preemption; then the run
    stops with Preempted). With ``trainer.async_save`` the workers' tensors are still being
    written when a save returns; a checkpoint is committed once every rank has finished, one
    background write at a time. ``workers``: the trainer's worker group; ``driver_state(step)``:
    the driver's part of a checkpoint.

    Each save's time is printed. A SIGTERM waits for the step in progress and its checkpoint: the
    first save that, with the longest step so far, does not fit ``trainer.signal_grace_s``
    (:func:`~megarl.runtime.signals.grace_needed_s`) is warned of once, with the grace to set."""

    def __init__(self, checkpoints: Checkpoints, trainer_cfg, workers, driver_state, config_yaml: str, preemption):
        self.checkpoints, self.t, self.workers = checkpoints, trainer_cfg, workers
        self.driver_state, self.config_yaml, self.preemption = driver_state, config_yaml, preemption
        self.in_flight: List[Path] = []  # async checkpoints whose tensors are still being written
        self.save_started: Dict[Path, float] = {}  # each uncommitted checkpoint's start (monotonic)
        self.longest_step_s = 0.0  # from one after_step's end to the next one's start
        self.step_end: Optional[float] = None
        self.grace_warned = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the loop: a SIGTERM lets the step in progress finish (``preemption.armed``).
        Slurm's preemption and a plain ``scancel`` signal every step of a job: the ranks, the
        run's Ray actors and the Ray nodes die beside the driver, and the step fails. A step that
        fails once a SIGTERM has come ends the run as Preempted, naming the checkpoint it resumes
        from, rather than as a crash."""
        import ray.exceptions

        from megarl.runtime.processes import WorkerDied
        from megarl.runtime.signals import Preempted

        self.preemption.armed = True
        try:
            yield
        except Exception as err:
            if isinstance(err, Preempted):
                raise
            # a rank or actor found dead may be found before the driver's own SIGTERM comes
            lost = isinstance(err, (WorkerDied, ray.exceptions.RayError))
            if not (self.preemption.heard() if lost else self.preemption.requested):
                raise
            newest = self.checkpoints.newest()
            resumes = (f"the newest checkpoint is {newest}: the requeued job or a rerun resumes from it" if newest else
                       "there is no checkpoint yet (trainer.save_interval): a rerun starts over")
            what = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise Preempted(f"SIGTERM, then the step in progress failed ({type(err).__name__}: {what}): Slurm's "
                            f"preemption and a plain scancel signal every step of the job, the ranks' too; the step "
                            f"is lost, {resumes}") from None
        self.preemption.armed = False

    def finish(self, blocking: bool) -> None:
        if self.in_flight and self.checkpoints.finished(
                self.in_flight[0], lambda: all(self.workers.call("finish_checkpoint", blocking))):
            self._commit(self.in_flight.pop())

    def _commit(self, tmp: Path) -> None:
        path = self.checkpoints.commit(tmp)
        save_s = time.monotonic() - self.save_started.pop(tmp)
        # an async save is seen finished at a step's end: its time is at most this
        written = "written in the background within" if self.t.async_save else "written in"
        self._check_grace(save_s)
        print(f"megarl: checkpoint {path.name} {written} {save_s:.1f} s", flush=True)

    def _check_grace(self, save_s: float) -> None:
        from megarl.runtime.signals import grace_needed_s, teardown_margin_s

        grace, work = self.t.signal_grace_s, self.longest_step_s + (save_s if self.t.save_on_signal else 0.0)
        if self.grace_warned or grace >= grace_needed_s(work):
            return
        self.grace_warned = True
        need = math.ceil(grace_needed_s(work) / 10) * 10
        print(f"megarl: warning: trainer.signal_grace_s={grace:g} s is short: a SIGTERM waits for the step in "
              f"progress (the longest so far took {self.longest_step_s:.1f} s) and its checkpoint (this one took "
              f"{save_s:.1f} s), and {teardown_margin_s(grace):g} s of the grace are kept for teardown; past the grace "
              f"the run stops without that checkpoint. Set trainer.signal_grace_s={need} or more, and under "
              f"launch/slurm/train.sbatch sbatch --signal=B:TERM@{need + 60}", file=sys.stderr, flush=True)

    def after_step(self, step: int) -> None:
        from megarl.runtime.signals import Preempted

        t = self.t
        if self.step_end is not None:
            self.longest_step_s = max(self.longest_step_s, time.monotonic() - self.step_end)
        self.finish(blocking=False)
        stop = self.preemption.requested
        if (stop and t.save_on_signal) or (t.save_interval and (step % t.save_interval == 0 or step == t.train_steps)):
            self.finish(blocking=True)  # one background write at a time
            started = time.monotonic()
            tmp = self.checkpoints.begin(step, lambda tmp: self.workers.call("save_checkpoint", str(tmp)),
                                         self.driver_state(step), self.config_yaml)
            self.save_started[tmp] = started
            if t.async_save:
                self.in_flight.append(tmp)
            else:
                self._commit(tmp)
        if stop:
            self.finish(blocking=True)
            saved = (f"checkpoint {self.checkpoints.newest()}" if t.save_on_signal else
                     "no checkpoint (trainer.save_on_signal=false)")
            since = time.monotonic() - self.preemption.requested_at
            raise Preempted(f"SIGTERM: stopped after step {step}, {saved} ({since:.1f} s after the signal, of "
                            f"trainer.signal_grace_s={t.signal_grace_s:g}); rerun the command to resume")
        self.step_end = time.monotonic()


def resume(checkpoints: Checkpoints, group, stream, scorer=None, kl=None) -> Tuple[int, Dict[str, str]]:
    """Load the newest usable checkpoint, if any, into the workers (``group``), the prompt (or
    ``megarl sft``'s example) stream, the reward-failure count (``scorer``) and the adaptive KL
    coefficient (``kl``): (the last step done, each tracker's run id), or (0, {})."""
    found = checkpoints.latest()
    if not found:
        return 0, {}
    path, driver = found
    same_layout = all(group.call("load_checkpoint", str(path)))
    stream.load_state(driver["stream"])
    if scorer is not None:
        scorer.failures = driver["reward_failures"]
    if kl is not None and "kl_coef" in driver:
        kl.value = driver["kl_coef"]
    relayout = "" if same_layout else " into another layout (weights, optimizer and schedule exact; RNG reseeded)"
    print(f"megarl: resuming after step {driver['step']} from {path}{relayout}", flush=True)
    run_ids = dict(driver.get("tracker_run_ids") or {})
    if driver.get("mlflow_run_id"):  # a checkpoint written before logging.backends
        run_ids.setdefault("mlflow", driver["mlflow_run_id"])
    return driver["step"], run_ids
