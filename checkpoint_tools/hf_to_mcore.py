"""HF safetensors -> Megatron dist checkpoint, one or a list of them: ``megarl convert hf-to-mcore``.

    python checkpoint_tools/hf_to_mcore.py HF_DIR OUT_DIR --tp 2 --nproc 2     # launches torchrun here
    torchrun --nproc-per-node 8 checkpoint_tools/hf_to_mcore.py HF_DIR OUT_DIR --tp 2 --ep 4
    srun python checkpoint_tools/hf_to_mcore.py --list jobs.txt --index "$SLURM_ARRAY_TASK_ID" --tp 2

jobs.txt: one ``HF_DIR OUT_DIR`` per line. Each output is written to OUT_DIR.tmp and renamed, with
conversion.json inside (the source's file hashes, the layout, megarl's version). Exit codes: 0
done, 2 bad input (named; no output left behind), 4 out of disk space. ``--help`` for the flags.
"""

import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module (that
# dataclasses, torch and the rest import) for a script run from here: take the folder off sys.path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from megarl.checkpoint.cli import main as convert  # noqa: E402 - after the path fix


def main(argv=None) -> int:
    return convert(["hf-to-mcore", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
