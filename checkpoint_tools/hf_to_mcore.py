"""HF safetensors -> Megatron dist checkpoint. Same as ``megarl convert hf-to-mcore``.

    torchrun --nproc-per-node 4 checkpoint_tools/hf_to_mcore.py HF_DIR OUT_DIR --tp 2 --pp 2
"""

import sys

from megarl.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-mcore", *sys.argv[1:]]))
