"""The README's first command, shortened: `megarl train-lm` launches torchrun, trains the tiny
model tensor-parallel over 2 CPU processes, and its loss falls; bad input exits non-zero."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from megarl.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_lm_loss_falls():
    cmd = [sys.executable, "-m", "megarl.cli", "train-lm", "configs/lm_demo.yaml",
           "trainer.train_steps=40", "trainer.log_interval=10"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    fell = re.search(r"loss fell from ([\d.]+) to ([\d.]+)", proc.stdout)
    assert fell, proc.stdout
    first, last = map(float, fell.groups())
    assert first > 5.0 and last < 2.6, (first, last)  # ln(256)=5.55 at start; the task is learnable


def test_cli_names_bad_key_and_exits_nonzero(capsys):
    assert main(["config", "configs/lm_demo.yaml", "parallel.actor.tpp=2"]) == 2
    assert "parallel.actor.tpp" in capsys.readouterr().err


def test_cli_refuses_impossible_layout_before_launch(capsys):
    assert main(["train-lm", "configs/lm_demo.yaml", "parallel.actor.tp=3"]) == 2
    err = capsys.readouterr().err
    assert "world size 2" in err and "3" in err


def test_cli_layout_dry_run(capsys):
    assert main(["layout", "configs/lm_demo.yaml", "parallel.actor.pp=2", "--world-size=8"]) == 0
    out = capsys.readouterr().out
    assert "(tp=2, pp=2, dp=2)" in out and "rank    7: tp=1 cp=0 dp=1 pp=1" in out
