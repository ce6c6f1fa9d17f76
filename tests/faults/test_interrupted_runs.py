"""Runs interrupted and resumed, and what an interrupted run leaves (issue 25, items 2 and 3).

One uninterrupted run (8 steps, a checkpoint every 2, in the ``dp_reshardable`` format) is the
reference of the module:
- preempted by SIGTERM, then killed with SIGKILL, then finished: the same metrics at every step and
  the same final weights;
- its checkpoint resumed at another tensor-parallel size, which that format cannot take: a named
  error raised on the ranks of a running world exits 2, every time, beside a CPU hog;
- ``megarl export-hf`` of it loads in transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.launch import ROOT

ARGS = ["configs/grpo_demo.yaml", "trainer.train_steps=8", "trainer.save_interval=2", "logging.progress_bar=false",
        "data.prompts_per_step=4", "algorithm.samples_per_prompt=4", "trainer.checkpoint_format=dp_reshardable"]
COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/clip_frac", "response/length_mean")
RUNS = 2  # of the failing multi-rank train,
HOGS = 1  # beside this many busy processes (of 2 cores: a run then takes about twice as long)


def command(run_dir):
    return [sys.executable, "-m", "megarl.cli", "train", *ARGS, f"trainer.run_dir={run_dir}"]


def env():
    return dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run the interrupted ones are compared with."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    subprocess.run(command(run_dir), cwd=ROOT, env=env(), check=True, capture_output=True, timeout=600)
    return run_dir


def assert_same_run(whole, resumed) -> None:
    """Every step's metrics and the final weights equal the uninterrupted run's."""
    a, b = metrics(whole), metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert {k: x[k] for k in COMPARED} == {k: y[k] for k in COMPARED}, x["step"]
    final_a = json.loads((whole / "final.json").read_text())
    final_b = json.loads((resumed / "final.json").read_text())
    assert final_a["actor_weights_checksum"] == final_b["actor_weights_checksum"]


def test_sigterm_then_sigkill_and_resume_match_an_uninterrupted_run(whole, tmp_path):
    """Preempted, then crashed, then finished: ends as the uninterrupted run.

    1. SIGTERM to the driver after step 3 (no checkpoint due: save_interval is 2): it finishes the
       step it is in, saves it, marks MLflow KILLED and exits 143 within trainer.signal_grace_s.
    2. The rerun resumes from that checkpoint; SIGKILL of its whole session (driver, Ray, workers)
       once it has saved step 6.
    3. The second rerun resumes from step 6 and finishes."""
    import mlflow

    run_dir, grace = tmp_path / "run", 120
    proc = subprocess.Popen(command(run_dir) + [f"trainer.signal_grace_s={grace}"], cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rows = run_dir / "metrics.jsonl"
        deadline = time.time() + 600
        while not (rows.exists() and len(rows.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its third step"
            time.sleep(0.02)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the driver alone, as Slurm's --signal=B or Kubernetes send it
        _, err = proc.communicate(timeout=grace)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"driver exited {took:.1f}s after SIGTERM")
    assert proc.returncode == 143, err[-3000:]
    assert took < grace and "Traceback" not in err, err[-3000:]
    stopped = len(metrics(run_dir))  # the step in progress at the signal, finished
    assert 3 <= stopped < 6
    latest = run_dir / "checkpoints" / "latest"
    name = latest.read_text()
    assert name == f"step_{stopped:06d}", name
    assert err.strip().splitlines()[-1] == (f"megarl train: preempted: SIGTERM: stopped after step {stopped}, checkpoint "
                                            f"{run_dir / 'checkpoints' / name}; rerun the command to resume"), err[-2000:]
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "KILLED"

    proc = subprocess.Popen(command(run_dir), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    deadline = time.time() + 600
    while not (latest.is_file() and latest.read_text() == "step_000006"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its checkpoint of step 6"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started in its session
    out, _ = proc.communicate()
    assert f"resuming after step {stopped}" in out
    assert not (run_dir / "final.json").exists(), "killed too late: the run had finished"

    done = subprocess.run(command(run_dir), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming after step 6" in done.stdout
    assert_same_run(whole, run_dir)


def test_export_hf_of_a_run(whole, tmp_path):
    import torch
    import transformers

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "export-hf", str(whole), str(out)], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # every tensor named and shaped right
    assert model.lm_head.weight.shape[0] == 23  # the vocabulary, padding stripped
    logits = model(torch.tensor([[1, 5, 6, 7, 8, 13]])).logits
    assert torch.isfinite(logits).all()
    again = subprocess.run([sys.executable, "-m", "megarl.cli", "export-hf", str(whole), str(out)], cwd=ROOT,
                           env=env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_a_failing_multi_rank_train_exits_2_every_time_under_load(whole, tmp_path):
    """A named error raised on the ranks of a running world (two Ray workers with their gloo
    groups, the driver's Ray alive): the uninterrupted run's ``dp_reshardable`` checkpoint resumed
    at tp=1, which that format cannot take. The error is the rank's, in one line."""
    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir)
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 300\nwhile time.time() < end: pass"])
            for _ in range(HOGS)]
    try:
        codes = []
        for _ in range(RUNS):
            proc = subprocess.run(command(run_dir) + ["parallel.actor.tp=1", "logging.backends=[console]"], cwd=ROOT,
                                  env=env(), capture_output=True, text=True, timeout=600)
            codes.append(proc.returncode)
            last = proc.stderr.strip().splitlines()[-1]
            assert last.startswith("megarl train: error: ") and "saved in the dp_reshardable format" in last, \
                proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr[-3000:]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert codes == [2] * RUNS
