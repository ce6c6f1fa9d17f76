"""Resuming a run directory under another config (issue 25, item 5): before any process starts,
another model is refused by name with exit 2 (no longer a raw dist-checkpoint shape error after
Ray started), a critic appearing is refused too, and other changes (optimizer.lr) are listed in
one warning; a layout change resumes as before, listed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megarl.cli import main as cli
from megarl.config import load_config, to_yaml
from megarl.entrypoints.train_rl import prepare
from megarl.trainer.checkpoint import Checkpoints
from megarl.trainer.resume import config_changes

DEMO = "configs/grpo_demo.yaml"
MOE = "model.hf_config=configs/models/tiny-qwen3-moe.json"


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with a checkpoint of the demo at step 2 (the driver's files; the roles'
    tensors are not needed to compare configs)."""
    path = tmp_path / "run"
    cfg = prepare(load_config([DEMO], [f"trainer.run_dir={path}"])).cfg
    Checkpoints(str(path), 2).save(2, lambda tmp: None, {"step": 2}, to_yaml(cfg))
    return path


def test_another_model_is_refused_by_name_before_ray(run_dir):
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", DEMO, f"trainer.run_dir={run_dir}", MOE],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step_000002" in proc.stderr and "model.hf_config: config_kwargs.num_moe_experts None -> 4" in proc.stderr
    assert "another trainer.run_dir" in proc.stderr
    assert "ray" not in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_a_critic_appearing_is_refused(run_dir, capsys):
    assert cli(["train", DEMO, f"trainer.run_dir={run_dir}", "algorithm.name=ppo", "--dry-run"]) == 2
    assert "algorithm.name=ppo: the checkpoint has no critic, this algorithm trains one" in capsys.readouterr().err


def test_other_changes_are_listed_in_one_warning(run_dir, capsys):
    assert cli(["train", DEMO, f"trainer.run_dir={run_dir}", "optimizer.lr=0.001", "parallel.actor.tp=1",
                "trainer.train_steps=300", "--dry-run"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megarl: warning: resuming")]
    assert len(warnings) == 1
    assert "optimizer.lr: 0.003 -> 0.001" in warnings[0] and "parallel.actor.tp: 2 -> 1" in warnings[0]
    assert "train_steps" not in warnings[0]  # extending a run is what a resume is for


def test_unchanged_config_and_fresh_run_dir_say_nothing(run_dir, tmp_path, capsys):
    assert cli(["train", DEMO, f"trainer.run_dir={run_dir}", "--dry-run"]) == 0
    assert cli(["train", DEMO, f"trainer.run_dir={tmp_path / 'new'}", MOE, "--dry-run"]) == 0
    assert cli(["train", DEMO, f"trainer.run_dir={run_dir}", MOE, "trainer.resume=false", "--dry-run"]) == 0
    assert "warning: resuming" not in capsys.readouterr().err


def test_config_changes_flattens_the_tree():
    a, b = load_config([DEMO]), load_config([DEMO], ["optimizer.lr=0.1", "trainer.train_steps=5"])
    assert config_changes(a, b) == {"optimizer.lr": (0.003, 0.1)}
