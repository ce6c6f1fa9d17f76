"""A converted checkpoint's logits against transformers' on sample prompts: ``megarl convert verify``.

    python checkpoint_tools/verify.py HF_DIR CKPT_DIR                          # either order
    torchrun --nproc-per-node 8 checkpoint_tools/verify.py HF_DIR CKPT_DIR --tp 8 --layers 4 --tol 1e-3
    srun python checkpoint_tools/verify.py --list jobs.txt --index "$SLURM_ARRAY_TASK_ID"

One side is a Megatron dist checkpoint, the other an HF directory (the conversion's source, or
its export), so a conversion's job list serves either direction. The Megatron model runs in the
layout the flags give (else the one conversion.json records), transformers' on rank 0's CPU,
both in float32. ``--layers N`` builds and reads only the first N layers on both sides, for a
model too large to check whole. Exit codes: 0 within --tol (default 1e-4), 1 above it, 2 bad
input.
"""

import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module (that
# dataclasses, torch and the rest import) for a script run from here: take the folder off sys.path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from megarl.checkpoint.cli import main as convert  # noqa: E402 - after the path fix


def main(argv=None) -> int:
    return convert(["verify", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
