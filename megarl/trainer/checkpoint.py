"""Run checkpoints: every role's training state (Megatron dist checkpoints written by the
workers), the driver's state (step, data position) and the config snapshot.

Atomic: a checkpoint is written into ``step_N.tmp``, listed in a manifest (every file's size and
SHA-256), renamed to ``step_N``, and only then named by the ``latest`` pointer (itself replaced
atomically). A directory still ending in ``.tmp`` is never used. On resume a checkpoint whose
files do not match its manifest, or whose dist-checkpoint metadata the allow-list refuses, is
reported (naming the file) and the one before it is used; ``export-hf`` refuses it instead.
The last ``keep`` stay.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

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
        """Write into ``step_N.tmp``; the workers' parts may still be in flight (async save)."""
        tmp = self.root / f"step_{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_roles(tmp)
        torch.save(driver_state, tmp / "driver.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        return tmp

    def commit(self, tmp: Path) -> Path:
        """Once every part of ``tmp`` is on disk: manifest, rename, ``latest``, keep-k."""
        final = tmp.with_name(tmp.name[: -len(".tmp")])
        # Once every worker's file is complete (async saves included): the workers hashed their
        # own files in parallel as they wrote them (save_train_state); this merges their digests
        # and hashes the rest (driver.pt, config.yaml, an async save's .metadata) here.
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.root / "latest")
        for old in self.complete()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return final

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
