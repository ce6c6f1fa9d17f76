"""Faults of the run directory, the data and the config (issue 15, items 4, 5 and 7): a second run
on a locked run_dir refuses with exit 2 and writes nothing; the lock dies with its holder; every
dataset row is checked before workers start (data.bad_rows=skip drops a bad row, naming
file:row); malformed YAML, an unknown reward and out-of-bounds sizes exit 2 naming the field; a
crashed run is FAILED in MLflow and an interrupted one KILLED, with artifacts and config.yaml
under run_dir and the reward-failure counts as metrics."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.cli import main as cli
from megarl.config import ConfigError, load_config
from megarl.entrypoints.train_rl import prepare, run
from megarl.trainer.run_dir import RunDirInUse, lock_run_dir

DEMO = "configs/grpo_demo.yaml"
BAD_ROW = 20


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_second_run_on_a_locked_run_dir_exits_2_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with lock_run_dir(str(run_dir)):  # as the driver of a running run holds it
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        before = snapshot(run_dir)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", DEMO, f"trainer.run_dir={run_dir}",
                               "logging.progress_bar=false"], capture_output=True, text=True, timeout=120)
        seconds = time.perf_counter() - start
        assert proc.returncode == 2, proc.stderr
        assert f"trainer.run_dir={run_dir} is in use by another run (pid {os.getpid()}" in proc.stderr
        assert "Traceback" not in proc.stderr and "ray" not in proc.stderr.lower()
        assert snapshot(run_dir) == before  # no metrics line, no mlflow.db, no MLflow run
        assert seconds < 60


def test_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom megarl.trainer.run_dir import lock_run_dir\n"
                               f"with lock_run_dir({str(tmp_path)!r}):\n    print('held', flush=True)\n    time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid} holds {tmp_path}/.lock"):
            with lock_run_dir(str(tmp_path)):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)  # a crashed driver: the kernel releases its lock
        holder.wait(timeout=30)
    with lock_run_dir(str(tmp_path)):
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"


def test_config_errors_exit_2_naming_the_file_or_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hf_config: [configs/models/tiny-digits.json\n  params_dtype: auto\n")
    cases = [([str(bad)], f"{bad}:3:15: invalid YAML: did not find expected ',' or ']'"),
             ([DEMO, "algorithm.reward_fn=nope"], "algorithm.reward_fn: unknown reward function 'nope'; available:"),
             ([DEMO, "optimizer.lr=-0.01", "data.prompts_per_step=0", "trainer.nproc_per_node=0"],
              "optimizer.lr=-0.01 must be >= 0; data.prompts_per_step=0 must be >= 1; "
              "trainer.nproc_per_node=0 must be >= 1")]
    for args, message in cases:
        assert cli(["train", *args, f"trainer.run_dir={tmp_path / 'run'}"]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def write_prompts(path: Path, rows: int = 30) -> Path:
    """Built-in-task prompts; row BAD_ROW is longer than the model's 64 positions."""
    lines = []
    for row in range(1, rows + 1):
        digits = "7" * 100 if row == BAD_ROW else f"{row * 37 % 10000:04d}"
        lines.append(json.dumps({"prompt": digits + "=", "answer": digits[::-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_row_is_checked_before_workers_start(tmp_path, caplog):
    data = write_prompts(tmp_path / "prompts.jsonl")
    with pytest.raises(ConfigError, match=rf"prompts.jsonl:{BAD_ROW}: prompt of 102 tokens exceeds the model's room "
                                          r"of 59 \(max positions - algorithm.max_new_tokens\) \(data.truncation=error; "
                                          r"left or right cuts such prompts, skip drops their rows\)"):
        prepare(load_config([DEMO], [f"data.train_files=[{data}]"]))
    with caplog.at_level(logging.WARNING):
        prepared = prepare(load_config([DEMO], [f"data.train_files=[{data}]", "data.bad_rows=skip"]))
    assert [r.source.rsplit(":", 1)[1] for r in prepared.stream.records] == [str(r) for r in range(1, 31) if r != BAD_ROW]
    assert f"skipping {data}:{BAD_ROW}: prompt of 102 tokens" in caplog.text


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def test_an_interrupted_run_is_killed_in_mlflow_with_artifacts_in_run_dir(tmp_path):
    from megarl.trainer.logger import RunLogger, end_unfinished_runs

    cfg = prepare(load_config([DEMO], [f"trainer.run_dir={tmp_path}", "logging.progress_bar=false"])).cfg
    log = RunLogger(cfg, total_steps=3)
    end_unfinished_runs(KeyboardInterrupt())
    run_info = mlflow_client(tmp_path).get_run(log.mlflow_run_id).info
    assert run_info.status == "KILLED"
    assert run_info.artifact_uri == (tmp_path / "mlartifacts" / log.mlflow_run_id / "artifacts").as_uri()
    logged = tmp_path / "mlartifacts" / log.mlflow_run_id / "artifacts" / "config.yaml"
    assert load_config([logged]) == cfg


def test_a_crashed_run_is_failed_in_mlflow(tmp_path, monkeypatch):
    """A real run on a dataset with a too-long row 20 (data.bad_rows=skip) whose reward function
    raises on every sample (str / str): two steps draw all 29 good rows, the failures are counted
    and reach MLflow, then the driver fails after step 2."""
    from megarl.trainer.logger import RunLogger

    def crash_after_step_2(self, step, batch, metrics):
        record = logged_step(self, step, batch, metrics)
        if step == 2:
            raise RuntimeError("planted driver failure after step 2")
        return record

    logged_step = RunLogger.step
    monkeypatch.setattr(RunLogger, "step", crash_after_step_2)
    data = write_prompts(tmp_path / "prompts.jsonl")
    run_dir = tmp_path / "run"
    cfg = load_config([DEMO], [f"trainer.run_dir={run_dir}", "logging.progress_bar=false", "trainer.train_steps=3",
                               f"data.train_files=[{data}]", "data.bad_rows=skip", "algorithm.reward_fn=operator:truediv",
                               "algorithm.reward_workers=1"])
    with pytest.raises(RuntimeError, match="planted driver failure"):
        run(prepare(cfg))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["reward/failures"] for r in rows] == [128, 128]  # 16 prompts x 8 samples, every one failed
    client = mlflow_client(run_dir)
    (found,) = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])
    assert found.info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(found.info.run_id, "reward/failures")] == [128, 128]
    assert (run_dir / "mlartifacts" / found.info.run_id / "artifacts" / "config.yaml").is_file()
    assert (run_dir / ".lock").read_text() == f"{os.getpid()}\n"  # the driver held the lock ...
    with lock_run_dir(str(run_dir)):  # ... and let it go
        pass
