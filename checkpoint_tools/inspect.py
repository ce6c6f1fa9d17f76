"""A checkpoint's tensors, shapes, dtypes, layout metadata and source config, or what differs
between two: ``megarl convert inspect``.

    python checkpoint_tools/inspect.py CKPT_DIR              # a dist checkpoint or an HF directory
    python checkpoint_tools/inspect.py A B                   # the tensors that differ, max |a - b|
    python checkpoint_tools/inspect.py --list jobs.txt       # each entry's output

Runs in one process (under a launcher, rank 0 reads). A diff reads one tensor, or one layer of a
stacked tensor, at a time. Exit codes: 0 (A B: the same tensors, bit for bit), 1 A and B differ,
2 bad input.
"""

import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module (that
# dataclasses, torch and the rest import) for a script run from here: take the folder off sys.path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from megarl.checkpoint.cli import main as convert  # noqa: E402 - after the path fix


def main(argv=None) -> int:
    return convert(["inspect", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
