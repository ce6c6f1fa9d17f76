"""The public GSM8K and MATH parquet files (the user brings them; nothing is downloaded) in the
dataset format ``megarl train`` reads, verl's: ``data_source``, ``prompt`` as chat messages,
``ability``, ``reward_model.ground_truth`` and ``extra_info``; with a validation split.

One table: each dataset names its question and solution columns, how the solution gives the
reference answer, the instruction appended to the question and the reward that judges it. The
scripts in ``scripts/data/`` call :func:`main` with a table entry.

- ``gsm8k``: openai/gsm8k (``main``: ``question``, ``answer`` ending ``#### 72``).
- ``math``: the MATH parquet files (hendrycks/competition_math, DigitalLearningGmbH/MATH-lighteval:
  ``problem``, ``solution`` with the answer in its last ``\\boxed{}``, ``level``, ``type``).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megarl.checkpoint.disk import replace_bytes
from megarl.rewards.verifiers import boxed_answer, gsm8k_answer


@dataclass(frozen=True)
class PublicDataset:
    data_source: str
    question: str
    """The column of the question."""
    solution: str
    """The column of the worked solution, which holds the reference answer."""
    answer: Callable[[str], Optional[str]]
    """The reference answer of a solution, None if it has none."""
    instruction: str
    """Appended to the question: where the model should put its answer (what the reward reads)."""
    reward_fn: str
    keep: tuple = ()
    """Other columns kept in extra_info."""


DATASETS: Dict[str, PublicDataset] = {
    "gsm8k": PublicDataset("openai/gsm8k", "question", "answer", gsm8k_answer,
                           'Let\'s think step by step and output the final answer after "####".', "gsm8k"),
    "math": PublicDataset("lighteval/MATH", "problem", "solution", boxed_answer,
                          "Let's think step by step and output the final answer within \\boxed{}.", "math",
                          keep=("level", "type")),
}


class PublicDataError(ValueError):
    """A file that is not the named dataset's; the message names the file and what is missing."""


def convert(name: str, path: Path, split: str) -> List[dict]:
    """The rows of one parquet file of dataset ``name`` in megarl's (verl's) format. A row without
    a reference answer is an error naming it."""
    import pyarrow.parquet as pq

    spec = DATASETS[name]
    table = pq.read_table(path)
    missing = [c for c in (spec.question, spec.solution, *spec.keep) if c not in table.column_names]
    if missing:
        raise PublicDataError(f"{path}: no column {missing} (columns: {table.column_names}); is it {spec.data_source}'s "
                              f"parquet file?")
    out = []
    for index, row in enumerate(table.to_pylist()):
        answer = spec.answer(row[spec.solution] or "")
        if answer is None:
            raise PublicDataError(f"{path}: row {index + 1} has no reference answer in '{spec.solution}'")
        out.append({
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": f"{row[spec.question]} {spec.instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": row[spec.question],
                           "solution": row[spec.solution], **{k: row[k] for k in spec.keep}},
        })
    return out


def write(rows: List[dict], path: Path) -> None:
    """``rows`` as parquet at ``path``, written to a temporary file and renamed."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    replace_bytes(path, buffer.getvalue(), f"{path.name}")


def main(name: str, argv=None) -> int:
    spec = DATASETS[name]
    parser = argparse.ArgumentParser(
        prog=f"scripts/data/prepare_{name}.py",
        description=f"{spec.data_source}'s parquet files -> OUT/train.parquet and OUT/val.parquet "
                    f"(algorithm.reward_fn={spec.reward_fn}).")
    parser.add_argument("--train", required=True, type=Path, help="the public train split's parquet file")
    parser.add_argument("--test", type=Path, help="the public test split's parquet file: the validation split "
                                                 "(without it, --val-size rows are held out of --train)")
    parser.add_argument("--val-size", type=int, default=None,
                        help="validation rows, drawn by --seed (default: all of --test; 500 held out of --train)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        for given in (args.train, args.test):
            if given is not None and not given.is_file():
                raise PublicDataError(f"{given} does not exist")
        train = convert(name, args.train, "train")
        rng = random.Random(args.seed)
        if args.test is not None:
            val = convert(name, args.test, "test")
            if args.val_size is not None:
                val = sorted(rng.sample(val, min(args.val_size, len(val))), key=lambda r: r["extra_info"]["index"])
        else:
            size = 500 if args.val_size is None else args.val_size
            if not 0 < size < len(train):
                raise PublicDataError(f"--val-size={size} must leave training rows: {args.train} has {len(train)}")
            held = set(rng.sample(range(len(train)), size))
            val = [r for i, r in enumerate(train) if i in held]
            train = [r for i, r in enumerate(train) if i not in held]
    except PublicDataError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write(train, args.out / "train.parquet")
    write(val, args.out / "val.parquet")
    print(f"{args.out / 'train.parquet'}: {len(train)} rows; {args.out / 'val.parquet'}: {len(val)} rows "
          f"(data_source {spec.data_source}; algorithm.reward_fn={spec.reward_fn})")
    return 0
