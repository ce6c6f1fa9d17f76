#!/usr/bin/env python3
"""The public GSM8K (openai/gsm8k) parquet files -> OUT/train.parquet, OUT/val.parquet in megarl's (verl's)
dataset format; see megarl/entrypoints/public_data.py. --help for the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without an install

from megarl.entrypoints.public_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("gsm8k"))
