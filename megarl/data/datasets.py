"""Prompt datasets: jsonl and parquet files of HF-style records, globs of them, and HF ``datasets``
directories (``Dataset.save_to_disk``; the extra ``datasets``). The built-in tasks: megarl.tasks.

A record has a prompt (a string, or a list of chat messages) under ``prompt_key`` and a
reference answer under ``answer_key`` (also looked up in ``reward_model.ground_truth``, the
verl/HF-datasets convention). Bad rows are reported with file and row number, and skipped or
fatal by config.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Union

from megarl.config.schema import BadRows

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset problem; the message names the file, row and field."""


@dataclass
class PromptRecord:
    prompt: Union[str, List[dict]]
    answer: Any
    source: str  # "file:row" or the task name
    extra: Dict[str, Any] = field(default_factory=dict)  # the row's other fields (a reward function may read them)


def expand_files(names: Sequence[str], key: str = "data.train_files") -> List[Path]:
    """``key``'s entries as paths: a file, an HF ``datasets`` directory, or a glob (``*``, ``?``,
    ``[``), its matches in sorted order. A missing file or a pattern that matches nothing is an
    error naming it."""
    out: List[Path] = []
    for name in names:
        if glob.has_magic(name):
            matches = sorted(glob.glob(name, recursive=True))
            if not matches:
                raise DataError(f"{key}: the pattern {name} matches no file")
            out.extend(Path(m) for m in matches)
        elif Path(name).is_file() or Path(name).is_dir():
            out.append(Path(name))
        else:
            raise DataError(f"dataset {name} does not exist ({key})")
    return out


def _hf_dataset(path: Path):
    """An HF ``datasets`` directory (``save_to_disk``) as a Dataset; a DatasetDict's directory is
    refused naming its splits."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{path} is a DatasetDict with splits {splits}: name one, e.g. {path / (splits or ['train'])[0]}")
    if not (path / "state.json").is_file():
        raise DataError(f"{path} is a directory but not an HF datasets directory (Dataset.save_to_disk writes "
                        f"state.json and data-*.arrow); give jsonl or parquet files, a glob, or such a directory")
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"{path} is an HF datasets directory, which needs the datasets package: "
                        f"pip install 'megarl[datasets]'") from err
    return datasets.load_from_disk(str(path))


def rows_of(path: Path) -> Iterator[tuple]:
    """(row number, row) of one dataset file or directory; a bad jsonl line as a DataError in its place."""
    if path.is_dir():
        yield from enumerate(_hf_dataset(path), 1)
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as err:
                    yield i, DataError(f"invalid JSON ({err.msg})")
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield i, row
    else:
        raise DataError(f"{path}: unsupported dataset format '{path.suffix}'; use .jsonl, .parquet or an HF "
                        f"datasets directory")


def _check(row: Any, prompt_key: str, answer_key: str) -> PromptRecord:
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError("is not a JSON object")
    if prompt_key not in row:
        raise DataError(f"has no '{prompt_key}' field (data.prompt_key); fields: {sorted(row)}")
    prompt = row[prompt_key]
    chat = isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt) and prompt
    if not (isinstance(prompt, str) and prompt.strip()) and not chat:
        raise DataError(f"'{prompt_key}' must be a non-empty string or a list of chat messages")
    answer = row.get(answer_key)
    if answer is None and isinstance(row.get("reward_model"), dict):
        answer = row["reward_model"].get("ground_truth")
    if answer is None:
        raise DataError(f"has no '{answer_key}' field (data.answer_key) nor reward_model.ground_truth")
    return PromptRecord(prompt, answer, "", {k: v for k, v in row.items() if k not in (prompt_key, answer_key)})


def load_records(files: Sequence[str], prompt_key: str = "prompt", answer_key: str = "answer",
                 bad_rows: BadRows = BadRows.fail, key: str = "data.train_files") -> List[PromptRecord]:
    """Every valid record of ``files`` (:func:`expand_files`; ``key`` names them in errors);
    ``bad_rows`` is ``fail`` (raise at the first) or ``skip`` (log each, go on)."""
    if bad_rows not in tuple(BadRows):
        raise DataError(f"data.bad_rows='{bad_rows}' must be one of {BadRows.allowed()}")
    out: List[PromptRecord] = []
    for path in expand_files(files, key):
        skipped = 0
        for row_number, row in rows_of(path):
            try:
                record = _check(row, prompt_key, answer_key)
            except DataError as err:
                where = f"{path}:{row_number}"
                if bad_rows == BadRows.fail:
                    raise DataError(f"{where} {err} (set data.bad_rows=skip to skip such rows)") from None
                log.warning("skipping %s: %s", where, err)
                skipped += 1
                continue
            record.source = f"{path}:{row_number}"
            out.append(record)
        if skipped:
            log.warning("%s: skipped %d bad row(s)", path, skipped)
    if not out:
        raise DataError(f"no valid records in {list(files)}")
    return out
