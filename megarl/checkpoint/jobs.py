"""Conversion jobs as users script them: many checkpoints from a list file (one ``SRC DST`` per
line; an sbatch array's task ``i`` takes entry ``i``), and the record each conversion leaves in its
output (``conversion.json``: the source's file hashes, the layout, megarl's version)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

import megarl
from megarl.checkpoint.integrity import HASH, file_digests

CONVERSION_RECORD = "conversion.json"  # inside a converted checkpoint (written before its rename)
COMMAND_LINE = "the command line"  # where a job not from a list came from


@dataclass(frozen=True)
class Job:
    """One conversion (or check) of ``source`` into (or against) ``output``."""

    source: Path
    output: Optional[Path]  # None: inspect's single checkpoint
    where: str = COMMAND_LINE  # for messages: ``FILE:LINE`` of a list entry


def read_jobs(list_file: str | Path) -> List[Job]:
    """The entries of a list file: ``SRC DST`` per line (whitespace-separated, no spaces inside a
    path); blank lines and ``#`` comments are skipped, so entry ``i`` is the i-th pair."""
    list_file = Path(list_file)
    if not list_file.is_file():
        raise FileNotFoundError(f"--list {list_file}: no such file")
    jobs = []
    for number, line in enumerate(list_file.read_text().splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{list_file}:{number}: expected 'SRC DST', got {len(fields)} field(s): {line.strip()!r}")
        jobs.append(Job(Path(fields[0]), Path(fields[1]), f"{list_file}:{number}"))
    if not jobs:
        raise ValueError(f"--list {list_file} has no 'SRC DST' entries")
    return jobs


def select_jobs(jobs: List[Job], index: Optional[int], list_file: str | Path) -> List[Job]:
    """Every entry, or with ``index`` (an sbatch array's ``$SLURM_ARRAY_TASK_ID``) only that one."""
    if index is None:
        return jobs
    if not 0 <= index < len(jobs):
        raise ValueError(f"--index {index} is outside {list_file}'s {len(jobs)} entries (0..{len(jobs) - 1}); "
                         f"submit the array as --array=0-{len(jobs) - 1}")
    return [jobs[index]]


def _hash_share(files: List[Path]) -> List[str]:
    """The SHA-256 of ``files``, each rank hashing every world_size-th one (collective)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = file_digests(files[rank::world])
    gathered: List[Optional[List[str]]] = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    return [gathered[i % world][i // world] for i in range(len(files))]


def conversion_record(direction: str, source: Path, files: List[Path], layout: Optional[Dict], options: Dict) -> Dict:
    """What :func:`write_record` leaves in a conversion's output: the source ``files`` it read,
    each with its bytes and SHA-256 (hashed by all ranks, each a share: collective), the world
    size and ``layout`` it was converted at, the ``options`` and megarl's version."""
    source = Path(source).absolute()
    files = sorted(Path(f).absolute() for f in files)
    digests = _hash_share(files)
    return {
        "megarl_version": megarl.__version__,
        "direction": direction,
        "source": str(source),
        "source_files": {(str(f.relative_to(source)) if f.is_relative_to(source) else str(f)):
                         {"bytes": f.stat().st_size, HASH: d} for f, d in zip(files, digests)},
        "world_size": torch.distributed.get_world_size(),
        "layout": layout,
        "options": options,
    }


def write_record(directory: Path, record: Dict) -> None:
    """Write ``record`` into ``directory`` (the temporary output, before its rename)."""
    (Path(directory) / CONVERSION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_record(directory: str | Path) -> Optional[Dict]:
    """A converted checkpoint's record, or None when it has none (an older megarl's, a run's)."""
    path = Path(directory) / CONVERSION_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
