"""Runs interrupted and resumed, and what an interrupted run leaves (issue 25, items 2 and 3).

One uninterrupted run (8 steps, a checkpoint every 2, in the ``dp_reshardable`` format) is the
reference of the module:
- preempted by SIGTERM, then killed with SIGKILL, then preempted under launch/slurm/train.sbatch by
  a SIGTERM to every step of the job, then requeued: the same metrics at every step and the same
  final weights;
- its checkpoint resumed at another tensor-parallel size, which that format cannot take: a named
  error raised on the ranks of a running world exits 2, every time, beside a CPU hog;
- ``megarl export-hf`` of it loads in transformers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.runtime.processes import descendants
from tests.distributed.launch import ROOT
from tests.faults.test_multinode import FAKES

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


# The job's driver: a real `megarl train` on a private Ray here, the cluster's address dropped
DRIVER = rf'''
[ "$1" = "-c" ] && exec {sys.executable} "$@"
args=()
for a in "$@"; do case "$a" in trainer.ray_address=*|trainer.node_ip_address=*) ;; *) args+=("$a") ;; esac; done
exec {sys.executable} "${{args[@]}}"'''


def sbatch(tmp_path, run_dir, name: str, **slurm_env) -> subprocess.Popen:
    """launch/slurm/train.sbatch in a fake one-node job of 2 GPUs (tests/faults/test_multinode.py's
    srun, scontrol and ray), its driver :data:`DRIVER`; stdout and stderr in ``tmp_path/name.out``,
    as Slurm's --output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for prog, body in {**FAKES, "python": DRIVER}.items():
        (bin_dir / prog).write_text("#!/usr/bin/env bash\n" + body.lstrip("\n") + "\n")
        (bin_dir / prog).chmod(0o755)
    job = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "RAY_"))} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / f"{name}.calls"),
        "FAKE_HOSTS": "gpu1", "MEGARL_PYTHON": str(bin_dir / "python"), "GPUS_PER_NODE": "2",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu1", **slurm_env}
    (tmp_path / f"{name}.calls.up").touch()  # the fake `ray health-check` answers at once: the head is up
    with open(tmp_path / f"{name}.out", "w") as out:
        return subprocess.Popen(["bash", "launch/slurm/train.sbatch", *ARGS, f"trainer.run_dir={run_dir}"], cwd=ROOT,
                                env=job, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_job(proc, limit_s: float) -> int:
    """The job's exit code; past ``limit_s`` the test fails."""
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not end within {limit_s}s") from None


def kill_job(proc) -> None:
    """SIGKILL to what is left of a job that has not ended."""
    if proc.poll() is None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run the interrupted ones are compared with, started in the background when
    the module's first case asks for it (beside that case's own first run); ``whole()`` waits for it
    and gives its run directory."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    with open(run_dir.parent / "whole.err", "w+") as err:
        proc = subprocess.Popen(command(run_dir), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)

        def finished() -> Path:
            if proc.returncode is None:
                try:
                    code = proc.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    raise AssertionError("the uninterrupted run did not end within 600 s") from None
                err.seek(0)
                assert code == 0, f"the uninterrupted run exited {code}:\n{err.read()[-3000:]}"
            return run_dir

        try:
            yield finished
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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
    """:func:`preempted_then_requeued`, the uninterrupted run beside it: the same steps and weights."""
    try:
        preempted_then_requeued(tmp_path)
    finally:
        uninterrupted = whole()  # started beside this case's runs
    assert_same_run(uninterrupted, tmp_path / "run")


def preempted_then_requeued(tmp_path):
    """Preempted, then crashed, then preempted on Slurm, then requeued: ends as the uninterrupted run.

    1. SIGTERM to the driver after step 3 (no checkpoint due: save_interval is 2): it finishes the
       step it is in, saves it, marks MLflow KILLED and exits 143 within trainer.signal_grace_s.
    2. The rerun resumes from that checkpoint, timing each save, and warns once that its grace of
       0.01 s is too short for them; SIGKILL of its whole session (driver, Ray, workers) once it has
       saved step 6.
    3. launch/slurm/train.sbatch resumes from step 6; after step 7, SIGTERM to every process of the
       job (a Slurm preemption, or a plain scancel): the ranks die with the driver, the step in
       progress is lost, and the job exits 143 with one line naming step 6's checkpoint.
    4. The job requeued (the script again, with SLURM_RESTART_COUNT=1) resumes from step 6 and
       finishes."""
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
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"megarl train: preempted: SIGTERM: stopped after step {stopped}, checkpoint "
                        rf"{re.escape(str(run_dir / 'checkpoints' / name))} \(\d+\.\d s after the signal, of "
                        rf"trainer\.signal_grace_s={grace}\); rerun the command to resume", last), err[-2000:]
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "KILLED"

    log = tmp_path / "rerun.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(command(run_dir) + ["trainer.signal_grace_s=0.01"], cwd=ROOT, env=env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while "megarl: checkpoint step_000006 written in" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its checkpoint of step 6"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started in its session
    proc.wait()
    out = log.read_text()
    assert f"resuming after step {stopped}" in out
    assert latest.read_text() == "step_000006" and not (run_dir / "final.json").exists(), "killed too late"
    # each save timed; the warning once, before the first save's line
    assert re.search(r"^megarl: checkpoint step_000006 written in \d+\.\d s$", out, re.M), out[-2000:]
    warnings = re.findall(r"^megarl: warning: trainer\.signal_grace_s=0\.01 s is short: .* Set trainer\.signal_grace_s="
                          r"(\d+) or more, and under launch/slurm/train\.sbatch sbatch --signal=B:TERM@(\d+)$", out, re.M)
    assert len(warnings) == 1 and int(warnings[0][1]) == int(warnings[0][0]) + 60, out[-3000:]

    killed_run = rows.stat().st_ino  # its step 7 may be there: the job's run rewrites the file at its start
    job = sbatch(tmp_path, run_dir, "preempted")
    try:
        deadline = time.time() + 600
        while "resuming after step 6" not in (tmp_path / "preempted.out").read_text():
            assert job.poll() is None and time.time() < deadline, "the job ended before resuming"
            time.sleep(0.05)
        every = {job.pid, *descendants(job.pid)}  # listed before: step 8 is quick, the signal must not lag
        while rows.stat().st_ino == killed_run or len(rows.read_text().splitlines()) < 7:
            assert job.poll() is None and time.time() < deadline, "the job ended before its step 7"
            time.sleep(0.005)
        for pid in every | set(descendants(job.pid)):  # as slurmstepd signals every process of every step
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        code = wait_job(job, 120)
    finally:
        kill_job(job)
    out = (tmp_path / "preempted.out").read_text()
    assert code == 143, out[-3000:]
    assert latest.read_text() == "step_000006" and not (run_dir / "final.json").exists()
    (line,) = [line for line in out.splitlines() if line.startswith("megarl train: preempted: ")]
    assert line.startswith("megarl train: preempted: SIGTERM, then the step in progress failed (") and line.endswith(
        "Slurm's preemption and a plain scancel signal every step of the job, the ranks' too; the step is lost, the "
        f"newest checkpoint is {run_dir / 'checkpoints' / 'step_000006'}: the requeued job or a rerun resumes from it"), \
        out[-3000:]

    job = sbatch(tmp_path, run_dir, "requeued", SLURM_RESTART_COUNT="1")
    try:
        code = wait_job(job, 600)
    finally:
        kill_job(job)
    out = (tmp_path / "requeued.out").read_text()
    assert code == 0, out[-3000:]
    assert "#SBATCH --requeue" in (ROOT / "launch" / "slurm" / "train.sbatch").read_text()
    assert "megarl: job 4242 requeued (restart 1): resuming from the run's newest checkpoint" in out
    assert "resuming after step 6" in out


def test_export_hf_of_a_run(whole, tmp_path):
    whole = whole()
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
    whole = whole()
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
