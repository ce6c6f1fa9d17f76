"""Exact resume: a run killed with SIGKILL in the middle of training (driver, Ray and workers)
and started again with the same command continues from its last checkpoint and ends with the
same metrics at every step and the same final weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.distributed.launch import ROOT

ARGS = ["configs/grpo_demo.yaml", "trainer.train_steps=8", "trainer.save_interval=2", "logging.progress_bar=false",
        "data.prompts_per_step=4", "algorithm.samples_per_prompt=4"]
COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/clip_frac", "response/length_mean")


def command(run_dir):
    return [sys.executable, "-m", "megarl.cli", "train", *ARGS, f"trainer.run_dir={run_dir}"]


def env():
    return dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_and_resume_match_an_uninterrupted_run(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(command(whole), cwd=ROOT, env=env(), check=True, capture_output=True, timeout=600)

    proc = subprocess.Popen(command(killed), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 600
    while not (latest.is_file() and latest.read_text() == "step_000002"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started in its session
    proc.wait()
    assert not (killed / "final.json").exists(), "killed too late: the run had finished"

    done = subprocess.run(command(killed), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming after step" in done.stdout
    a, b = metrics(whole), metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert {k: x[k] for k in COMPARED} == {k: y[k] for k in COMPARED}, x["step"]
    final_a = json.loads((whole / "final.json").read_text())
    final_b = json.loads((killed / "final.json").read_text())
    assert final_a["actor_weights_checksum"] == final_b["actor_weights_checksum"]
