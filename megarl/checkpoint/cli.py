"""``megarl convert hf-to-mcore|mcore-to-hf``; under torchrun/srun: ``python -m megarl.checkpoint.cli ...``.

Run it plainly (one process, or ``--nproc N`` to have it launch torchrun on this node), or start
it yourself with torchrun/srun on many nodes. Errors name the tensor or field, exit with 2 (4 when
out of disk space), and leave no output directory behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from megarl.checkpoint.disk import DiskFull
from megarl.checkpoint.hf_io import CheckpointFileError, parse_size
from megarl.runtime.distributed import torn_down


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    to_mcore.add_argument("hf_dir")
    to_mcore.add_argument("out_dir")
    for axis in ("tp", "pp", "ep", "cp"):
        to_mcore.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size of the converting layout")
    to_mcore.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
    to_mcore.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    to_mcore.add_argument("--params-dtype", default="auto", help="auto (the HF weights' dtype), float32, bfloat16")
    to_mcore.add_argument("--vocab-multiple", type=int, default=128, help="pad the vocabulary to a multiple of this")
    to_mcore.add_argument("--transformer-impl", default="auto", help="auto, local or transformer_engine")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("ckpt_dir")
    to_hf.add_argument("out_dir")
    to_hf.add_argument("--dtype", default="auto", help="auto (the source HF dtype), float32, bfloat16, float16")
    to_hf.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 5GB")
    to_hf.add_argument("--hf-config", default=None, help="directory with config.json if the checkpoint lacks hf/")
    for p in (to_mcore, to_hf):
        p.add_argument("--nproc", type=int, default=None, help="launch torchrun with this many processes here")
    return parser


def _launch(argv: List[str], nproc: int, out_dir: str) -> int:
    rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
    rest = [a for a in rest if not a.startswith("--nproc=")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megarl.checkpoint.cli", *rest]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if subprocess.call(cmd, env=env) == 0:
        return 0
    # The ranks printed the reason; a rank killed mid-write (torchrun stops the others when one
    # fails) cannot clean up after itself.
    out = Path(out_dir)
    shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    from megarl.checkpoint.convert import (
        ConvertOptions, hf_to_mcore, mcore_to_hf, prepare_hf_to_mcore, prepare_mcore_to_hf,
    )
    from megarl.config import ParallelConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    launch = bool(args.nproc) and "RANK" not in os.environ
    try:
        with torn_down():  # a torchrun rank's exit code is its own, whatever groups it started
            if args.direction == "hf-to-mcore":
                parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp,
                                          vpp=args.vpp)
                options = ConvertOptions(args.vocab_multiple, args.params_dtype, args.transformer_impl)
                if launch:  # refuse bad input here, before starting any process
                    prepare_hf_to_mcore(args.hf_dir, args.out_dir, parallel, options, args.nproc)
                    return _launch(argv, args.nproc, args.out_dir)
                hf_to_mcore(args.hf_dir, args.out_dir, parallel, options)
            elif launch:  # refuse bad input (names, truncated files) before starting any process
                prepare_mcore_to_hf(args.ckpt_dir, args.out_dir, args.hf_config)
                return _launch(argv, args.nproc, args.out_dir)
            else:
                mcore_to_hf(args.ckpt_dir, args.out_dir, args.dtype, parse_size(args.max_shard_size),
                            args.hf_config)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        rank = os.environ.get("RANK", "0")
        # Checks before the launch fail alike on every rank; a file that fails to read does so
        # on the rank that reads it.
        if rank == "0" or isinstance(exc, CheckpointFileError):
            print(f"megarl convert {args.direction}: error: {exc}", file=sys.stderr)
        return 2
    except DiskFull as exc:  # on the ranks whose writes ran out of space
        print(f"megarl convert {args.direction}: error: {exc}", file=sys.stderr)
        return 4
    if os.environ.get("RANK", "0") == "0":
        print(f"megarl convert {args.direction}: wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
