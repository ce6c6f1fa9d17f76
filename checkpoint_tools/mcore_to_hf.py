"""Megatron dist checkpoint -> HF safetensors, one or a list of them: ``megarl convert mcore-to-hf``.

    python checkpoint_tools/mcore_to_hf.py CKPT_DIR OUT_DIR --dtype bfloat16 --nproc 4
    torchrun --nproc-per-node 8 checkpoint_tools/mcore_to_hf.py CKPT_DIR OUT_DIR
    srun python checkpoint_tools/mcore_to_hf.py --list jobs.txt --index "$SLURM_ARRAY_TASK_ID"

jobs.txt: one ``CKPT_DIR OUT_DIR`` per line. The ranks split the tensors by layer (any number of
ranks; no model is built). Each output is written to OUT_DIR.tmp and renamed, with
conversion.json inside (the source's file hashes, megarl's version). Exit codes: 0 done, 2 bad
input (named; no output left behind), 4 out of disk space. ``--help`` for the flags.
"""

import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module (that
# dataclasses, torch and the rest import) for a script run from here: take the folder off sys.path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from megarl.checkpoint.cli import main as convert  # noqa: E402 - after the path fix


def main(argv=None) -> int:
    return convert(["mcore-to-hf", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
