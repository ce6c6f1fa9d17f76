"""What megarl trusts in a checkpoint: the content hash of every file (``manifest.json``), and
torch's dist-checkpoint ``.metadata`` pickle read through an allow-list, so that a crafted file
can name no code to run.

SHA-256: with the SHA extensions of current x86 and ARM CPUs it hashes at about 1.1 GB/s in
one core (blake2b: 0.6 GB/s on the same machine), and ``sha256sum -c`` can check a file by hand.
The hash detects corruption (bit rot, a partial copy, flipped bytes), not tampering: whoever
can rewrite a file can rewrite the manifest too; the allow-list is what keeps a crafted
checkpoint from running code.

Hashed where the files are written: each rank records the digests of the files it wrote in a
sidecar (``.hashes/rank_<r>.json``, inside the async writer for an async save), in parallel
over the ranks; ``write_manifest`` merges them and hashes only what no rank recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from megarl.checkpoint.hf_io import CheckpointFileError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HASH = "sha256"
HASHES_DIR = ".hashes"  # the ranks' sidecars, merged into the manifest and removed by write_manifest


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH).hexdigest()


def file_digests(files: List[Path]) -> List[str]:
    """The files' SHA-256, several at a time: hashlib releases the GIL while it reads and hashes."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(file_digest, files))


def record_hashes(directory: Path, files: List[Path], rank: int) -> None:
    """Leave the SHA-256 of ``files`` (complete, under ``directory``) in
    ``directory/.hashes/rank_<rank>.json`` for :func:`write_manifest`. Never raises: a file
    whose digest is not recorded is hashed by ``write_manifest`` instead."""
    try:
        entries = {}
        for file, digest in zip(files, file_digests(files)):
            st = file.stat()  # size and mtime tell write_manifest the file is still the one hashed
            entries[str(file.relative_to(directory))] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                          HASH: digest}
        (directory / HASHES_DIR).mkdir(exist_ok=True)
        tmp = directory / HASHES_DIR / f"rank_{rank}.json.tmp"
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, tmp.with_suffix(""))
    except OSError as exc:
        log.warning("rank %d could not record its checkpoint hashes (the driver hashes them): %s", rank, exc)


def write_then_record_hashes(write, directory: Path, rank: int, files, *args, **kwargs) -> None:
    """``write(*args, **kwargs)`` (an async save's writer), then :func:`record_hashes` of
    ``files()``: this rank's files, hashed in the background process that wrote them."""
    write(*args, **kwargs)
    record_hashes(directory, files(), rank)


def _recorded_hashes(directory: Path) -> Dict[str, dict]:
    """The ranks' sidecars under ``directory`` (file -> size, mtime, digest); removes them."""
    recorded = {}
    for sidecars in sorted(d for d in directory.rglob(HASHES_DIR) if d.is_dir()):
        for sidecar in sorted(sidecars.glob("rank_*.json")):
            try:
                entries = json.loads(sidecar.read_text())
            except ValueError:  # torn by a crash: its files are hashed here
                continue
            base = sidecars.parent.relative_to(directory)
            recorded.update({str(base / name): entry for name, entry in entries.items()})
        shutil.rmtree(sidecars)
    return recorded


def write_manifest(directory: Path, hashes: bool = True) -> Dict[str, dict]:
    """Record every file under ``directory`` (its size and, with ``hashes``, its SHA-256) in
    ``directory/manifest.json``, written atomically. A digest a rank recorded
    (:func:`record_hashes`) is taken when the file still has the size and mtime it was hashed
    at; every other file is hashed here. ``hashes=False`` exists for the benchmark's
    side-by-side timing."""
    recorded = _recorded_hashes(directory)
    files = [f for f in sorted(directory.rglob("*")) if f.is_file() and f.name != MANIFEST]
    entries = {str(f.relative_to(directory)): {"bytes": f.stat().st_size} for f in files}
    if hashes:
        missing = []
        for file, (name, entry) in zip(files, entries.items()):
            known = recorded.get(name)
            if known and (known["bytes"], known["mtime_ns"]) == (entry["bytes"], file.stat().st_mtime_ns):
                entry[HASH] = known[HASH]
            else:
                missing.append((file, entry))
        for (_, entry), digest in zip(missing, file_digests([file for file, _ in missing])):
            entry[HASH] = digest
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(entries, indent=0))
    os.replace(tmp, directory / MANIFEST)
    return entries


def verify_manifest(directory: Path, under: Optional[str] = None) -> None:
    """Check the files ``directory/manifest.json`` lists (only those below ``under``, a
    subdirectory, if given) against their recorded size and hash. Raises
    :class:`CheckpointFileError` naming the first file that differs. A manifest of sizes only
    (megarl before hashes) is accepted with a warning."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise CheckpointFileError(f"{directory}: no {MANIFEST} (not a complete megarl checkpoint)")
    try:
        entries = json.loads(manifest.read_text())
    except ValueError as exc:
        raise CheckpointFileError(f"{manifest} is not valid JSON: {exc}") from None
    if not isinstance(entries, dict) or not all(isinstance(e, (int, dict)) for e in entries.values()):
        raise CheckpointFileError(f"{manifest} is not a megarl checkpoint manifest (file -> size and hash)")
    prefix = f"{under.rstrip('/')}/" if under else ""
    recorded = {}  # file -> its recorded hash
    for name, entry in entries.items():
        if not name.startswith(prefix):
            continue
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("bytes"), entry.get(HASH))
        file = directory / name
        if not file.is_file():
            raise CheckpointFileError(f"{file} is missing (listed in {manifest})")
        if file.stat().st_size != size:
            raise CheckpointFileError(f"{file} has {file.stat().st_size} bytes, the manifest says {size}")
        if digest is not None:
            recorded[file] = digest
    for (file, digest), found in zip(recorded.items(), file_digests(list(recorded))):
        if found != digest:
            raise CheckpointFileError(f"{file} does not match its {HASH} in {manifest} (corrupt or modified)")
    if len(recorded) < sum(name.startswith(prefix) for name in entries):
        log.warning("%s records no content hashes (written before megarl hashed checkpoints): only file "
                    "sizes were checked", manifest)
        print(f"megarl: warning: {manifest} records no content hashes (an older megarl): only file sizes "
              f"were checked", flush=True)


def manifest_root(path: Path) -> Optional[Path]:
    """The directory whose manifest covers ``path``: itself, or a run checkpoint ``step_N``
    holding it as a role's subdirectory (``step_N/actor``); None when there is none."""
    for candidate in (path, path.parent):
        if (candidate / MANIFEST).is_file():
            return candidate
    return None


def _dist_checkpoint_globals() -> Dict[str, frozenset]:
    """module -> the names a dist checkpoint's ``.metadata`` (written by torch or megatron-core)
    may load: torch's metadata and planner records, ``torch.Size``, the dtypes, and plain
    containers and paths; all of them build data and run nothing else."""
    import torch

    dtypes = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))
    return {
        "torch.distributed.checkpoint.metadata": frozenset({
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
            "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
        "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "SerializationFormat"}),
        "torch.distributed.checkpoint.planner": frozenset({
            "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
        # a layout name -> torch.layout, by table lookup
        "torch.serialization": frozenset({"_get_layout"}),
        "torch": frozenset({"Size"}) | dtypes,
        "collections": frozenset({"OrderedDict"}),
        # torch's own writer records the checkpoint id (its path) in StorageMeta
        "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
        "builtins": frozenset({"set", "frozenset"}),
    }


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source
        self.allowed = _dist_checkpoint_globals()

    def find_class(self, module: str, name: str):
        if name not in self.allowed.get(module, ()):
            raise CheckpointFileError(f"{self.source}: refused to unpickle {module}.{name}: not one of the "
                                      f"classes torch's dist-checkpoint metadata is made of (a crafted or "
                                      f"foreign file?)")
        return super().find_class(module, name)


def load_dist_metadata(path: Path):
    """A dist checkpoint's ``.metadata`` (torch's ``Metadata``), unpickled through the allow-list.
    Raises :class:`CheckpointFileError` naming the file."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except CheckpointFileError:
        raise
    except Exception as exc:  # a truncated or corrupt pickle raises anything from EOFError on
        raise CheckpointFileError(f"{file} is unreadable (truncated or corrupt?): "
                                  f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointFileError(f"{file} holds a {type(metadata).__name__}, not torch's checkpoint Metadata")
    return metadata


def safe_reader(path: Path):
    """A torch ``FileSystemReader`` for ``path`` whose metadata goes through the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata files: megarl never writes them
                raise CheckpointFileError(f"{self.path}: per-rank metadata files are not supported")
            metadata = load_dist_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


@contextlib.contextmanager
def weights_only_loads():
    """Every ``torch.load`` inside runs with ``weights_only=True``: megatron-core's load of
    ``common.pt``, and torch's load of a dist checkpoint's pickled objects (``_extra_state``),
    which passes ``weights_only=False`` itself; torch honours this variable over that argument."""
    saved = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved
