"""``megarl convert hf-to-mcore|mcore-to-hf|verify|inspect``; checkpoint_tools/*.py run the same
(under torchrun/srun also ``python -m megarl.checkpoint.cli ...``).

Each takes one ``SRC DST`` pair or ``--list FILE`` of them (one ``SRC DST`` per line), all of it or
with ``--index I`` only entry I (an sbatch array's ``$SLURM_ARRAY_TASK_ID``). Run it plainly (one
process, or ``--nproc N`` to have it launch torchrun on this node), or start it yourself with
torchrun/srun on many nodes. A conversion is written to ``DST.tmp`` and renamed, with
``conversion.json`` (the source's file hashes, the layout, megarl's version) inside; ``verify``
compares a dist checkpoint's logits with transformers' on the HF side of the pair; ``inspect``
lists a checkpoint, or compares two.

Exit codes: 0 done (verify: within --tol; inspect A B: the same tensors); 1 verify above --tol, or
inspect A B found differences; 2 bad input (the tensor, field or list line named; no output left
behind); 4 out of disk space. ``verify --nproc N`` exits as torchrun does when a rank fails (1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import torch

from megarl.checkpoint.disk import DiskFull
from megarl.checkpoint.hf_io import CheckpointFileError, parse_size
from megarl.checkpoint.jobs import COMMAND_LINE, Job, read_jobs, read_record, select_jobs
from megarl.runtime.distributed import torn_down

LAYOUT_AXES = ("tp", "pp", "ep", "etp", "vpp")  # verify's layout (cp splits activations, not weights)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    for axis in ("tp", "pp", "ep", "cp"):
        to_mcore.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size of the converting layout")
    to_mcore.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
    to_mcore.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    to_mcore.add_argument("--params-dtype", default="auto", help="auto (the HF weights' dtype), float32, bfloat16")
    to_mcore.add_argument("--vocab-multiple", type=int, default=128, help="pad the vocabulary to a multiple of this")
    to_mcore.add_argument("--transformer-impl", default="auto", help="auto, local or transformer_engine")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    to_hf.add_argument("--dtype", default="auto", help="auto (the source HF dtype), float32, bfloat16, float16")
    to_hf.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 5GB")
    to_hf.add_argument("--hf-config", default=None, help="directory with config.json if the checkpoint lacks hf/")
    verify = sub.add_parser("verify", help="a dist checkpoint's logits against transformers' on an HF directory",
                            description="SRC DST: a Megatron dist checkpoint and an HF directory, in either order. "
                                        "The layout defaults to the one conversion.json records, else 1 per axis.")
    for axis in LAYOUT_AXES:
        verify.add_argument(f"--{axis}", type=int, default=None, help=f"{axis} size of the checking layout")
    verify.add_argument("--tol", type=float, default=None, help="largest allowed |logit difference| (default 1e-4)")
    verify.add_argument("--layers", type=int, default=None,
                        help="check only the first N layers (memory: N layers instead of all; rounded up to pp*vpp)")
    verify.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; needs a tokenizer)")
    inspect = sub.add_parser("inspect", help="list a checkpoint's tensors and metadata, or compare two (SRC DST)",
                             description="CKPT: list it; A B: the tensors that differ (max abs difference). "
                                         "With --list: each entry's DST.")
    for p in (to_mcore, to_hf, verify, inspect):
        p.add_argument("src", nargs="?", help="source (inspect: the checkpoint)")
        p.add_argument("dst", nargs="?", help="output (verify: the other side; inspect: the one to compare with)")
        p.add_argument("--list", default=None, help="a file of 'SRC DST' lines, instead of SRC DST")
        p.add_argument("--index", type=int, default=None, help="with --list: only its entry I (0-based)")
    for p in (to_mcore, to_hf):
        p.add_argument("--skip-existing", action="store_true",
                       help="skip the entries whose output exists (outputs appear only when complete)")
    for p in (to_mcore, to_hf, verify):
        p.add_argument("--nproc", type=int, default=None, help="launch torchrun with this many processes here")
    return parser


def _jobs(args) -> List[Job]:
    """The pairs to work on: SRC DST, or the --list's entries (or its --index-th)."""
    if args.list is not None:
        if args.src is not None:
            raise ValueError(f"give SRC DST or --list FILE, not both (got {args.src!r} and --list {args.list})")
        return select_jobs(read_jobs(args.list), args.index, args.list)
    if args.index is not None:
        raise ValueError("--index picks an entry of --list FILE; give --list too")
    if args.src is None or (args.dst is None and args.direction != "inspect"):
        raise ValueError(f"{args.direction} needs SRC DST (or --list FILE)")
    return [Job(Path(args.src), Path(args.dst) if args.dst else None)]


def _launch(argv: List[str], nproc: int, outputs: List[Path]) -> int:
    rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
    rest = [a for a in rest if not a.startswith("--nproc=")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megarl.checkpoint.cli", *rest]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    code = subprocess.call(cmd, env=env)
    # The ranks printed the reason; a rank killed mid-write (torchrun stops the others when one
    # fails) cannot clean up after itself.
    for out in outputs if code else ():
        shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    return code


@contextlib.contextmanager
def _naming(job: Job) -> Iterator[None]:
    """Errors of a --list entry start with its FILE:LINE."""
    try:
        yield
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        if job.where == COMMAND_LINE:
            raise
        kind = CheckpointFileError if isinstance(exc, CheckpointFileError) else ValueError
        raise kind(f"{job.where}: {exc}") from exc


def _rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _convert(args, jobs: List[Job], launch: bool, argv: List[str]) -> int:
    from megarl.checkpoint.convert import (
        ConvertOptions, hf_to_mcore, mcore_to_hf, prepare_hf_to_mcore, prepare_mcore_to_hf,
    )
    from megarl.config import ParallelConfig

    if args.skip_existing:
        for job in (j for j in jobs if j.output.exists()):
            if _rank0():
                print(f"megarl convert {args.direction}: {job.output} exists ({job.where}): skipped")
        jobs = [j for j in jobs if not j.output.exists()]
    parallel = options = None
    if args.direction == "hf-to-mcore":
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp, vpp=args.vpp)
        options = ConvertOptions(args.vocab_multiple, args.params_dtype, args.transformer_impl)
    if launch:  # refuse bad input here, before starting any process
        for job in jobs:
            with _naming(job):
                if parallel is not None:
                    prepare_hf_to_mcore(job.source, job.output, parallel, options, args.nproc)
                else:  # names, truncated files
                    prepare_mcore_to_hf(job.source, job.output, args.hf_config)
        return 2 if _launch(argv, args.nproc, [j.output for j in jobs]) else 0
    for job in jobs:
        with _naming(job):
            if parallel is not None:
                hf_to_mcore(job.source, job.output, parallel, options, record=True)
            else:
                mcore_to_hf(job.source, job.output, args.dtype, parse_size(args.max_shard_size), args.hf_config,
                            record=True)
        if _rank0():
            print(f"megarl convert {args.direction}: wrote {job.output}", flush=True)
    return 0


def _verify_layout(args, checkpoint: Path, world: int):
    """The checking layout: the flags', if any is given (the rest 1, or data parallel), else the one
    the checkpoint's conversion.json records, else 1 per axis."""
    from megarl.config import ParallelConfig
    from megarl.parallel.layout import Layout, LayoutError

    given = {axis: getattr(args, axis) for axis in LAYOUT_AXES if getattr(args, axis) is not None}
    recorded = (read_record(checkpoint) or {}).get("layout") or {}
    sizes = given or {axis: recorded[axis] for axis in LAYOUT_AXES if recorded.get(axis) is not None}
    try:
        return Layout.from_config(ParallelConfig(**sizes), world)
    except LayoutError as exc:
        source = "the flags" if given else f"{checkpoint}'s conversion.json" if recorded else "the defaults"
        raise LayoutError(f"verify's layout ({' '.join(f'{k}={v}' for k, v in sizes.items()) or 'tp=pp=1'}, from "
                          f"{source}) on {world} ranks: {exc}") from None


def _verify(args, jobs: List[Job], launch: bool, argv: List[str]) -> int:
    from megarl.checkpoint.load import check_pretrained
    from megarl.checkpoint.verify import DEFAULT_TOL, pair, plan, verify
    from megarl.parallel import build_groups
    from megarl.runtime import init_distributed, world_size_from_env

    tol = DEFAULT_TOL if args.tol is None else args.tol
    world = args.nproc if launch else world_size_from_env()
    checks = []
    for job in jobs:  # every pair and layout checked before any process group exists
        with _naming(job):
            sides = pair(job.source, job.output)
            layout = _verify_layout(args, sides.checkpoint, world)
            made = plan(sides.checkpoint, sides.hf, layout, args.layers)
            if not torch.distributed.is_initialized():  # (a caller's world: it checked its own inputs)
                # every tensor the HF side's model needs, named, shaped and typed (a model on the meta device)
                check_pretrained(sides.checkpoint, made.model_cfg, field=f"verify {sides.hf}: the checkpoint")
        checks.append((sides, layout))
    if launch:
        return _launch(argv, args.nproc, [])
    init_distributed()
    failed = 0
    for sides, layout in checks:
        groups = build_groups(layout)
        try:
            result = verify(sides.checkpoint, sides.hf, groups, args.layers, args.prompt)
        finally:
            groups.destroy()
        failed += not result.passed(tol)
        if _rank0():
            print(f"megarl convert verify: {sides.checkpoint} against {sides.hf} at {layout}: {result.line(tol)}",
                  flush=True)
    return 1 if failed else 0


def _inspect(args, jobs: List[Job], launch: bool, argv: List[str]) -> int:
    from megarl.checkpoint.inspection import describe, diff_lines

    if not _rank0():  # one process reads; the other ranks of a launcher have nothing to do
        return 0
    if args.list is None and jobs[0].output is not None:
        lines, same = diff_lines(jobs[0].source, jobs[0].output)
        print("\n".join(lines), flush=True)
        return 0 if same else 1
    for job in jobs:
        print("\n".join(describe(job.output if args.list is not None else job.source)), flush=True)
    return 0


COMMANDS = {"hf-to-mcore": _convert, "mcore-to-hf": _convert, "verify": _verify, "inspect": _inspect}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    launch = bool(getattr(args, "nproc", None)) and "RANK" not in os.environ
    # a torchrun rank's exit code is its own, whatever groups it started; a world a caller
    # started (main called in its process) is the caller's
    owned = torn_down() if not torch.distributed.is_initialized() else contextlib.nullcontext()
    try:
        with owned:
            return COMMANDS[args.direction](args, _jobs(args), launch, argv)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        # Checks before the launch fail alike on every rank; a file that fails to read does so
        # on the rank that reads it.
        if _rank0() or isinstance(exc, CheckpointFileError):
            print(f"megarl convert {args.direction}: error: {exc}", file=sys.stderr)
        return 2
    except DiskFull as exc:  # on the ranks whose writes ran out of space
        print(f"megarl convert {args.direction}: error: {exc}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
