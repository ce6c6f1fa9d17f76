"""Prompt datasets: jsonl and parquet files of HF-style records (the built-in tasks: megarl.tasks).

A record has a prompt (a string, or a list of chat messages) under ``prompt_key`` and a
reference answer under ``answer_key`` (also looked up in ``reward_model.ground_truth``, the
verl/HF-datasets convention). Bad rows are reported with file and row number, and skipped or
fatal by config.
"""

from __future__ import annotations

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


def _rows(path: Path) -> Iterator[tuple]:
    if path.suffix == ".jsonl":
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
        raise DataError(f"{path}: unsupported dataset format '{path.suffix}'; use .jsonl or .parquet")


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
                 bad_rows: BadRows = BadRows.fail) -> List[PromptRecord]:
    """Every valid record of ``files``; ``bad_rows`` is ``fail`` (raise at the first) or ``skip``
    (log each, go on)."""
    if bad_rows not in tuple(BadRows):
        raise DataError(f"data.bad_rows='{bad_rows}' must be one of {BadRows.allowed()}")
    out: List[PromptRecord] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"dataset {path} does not exist (data.train_files)")
        skipped = 0
        for row_number, row in _rows(path):
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
