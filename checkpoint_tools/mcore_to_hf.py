"""Megatron dist checkpoint -> HF safetensors. Same as ``megarl convert mcore-to-hf``.

    torchrun --nproc-per-node 4 checkpoint_tools/mcore_to_hf.py CKPT_DIR OUT_DIR --dtype bfloat16
"""

import sys

from megarl.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main(["mcore-to-hf", *sys.argv[1:]]))
