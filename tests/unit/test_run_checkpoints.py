"""Run checkpoints on disk: atomic rename and `latest` pointer, half-written directories never
used, a corrupt or missing checkpoint reported and the previous one used, the last k kept; when a
run saves, each save timed against trainer.signal_grace_s, and ranks lost to a SIGTERM."""

import dataclasses
import hashlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from megarl.config.schema import TrainerConfig
from megarl.runtime.processes import WorkerDied
from megarl.runtime.signals import Preempted, Preemption, grace_needed_s, teardown_margin_s
from megarl.trainer.checkpoint import CheckpointSchedule, Checkpoints


def write_roles(tmp):
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights.bin").write_bytes(b"x" * 100)


def save(ck, step):
    return ck.save(step, write_roles, {"step": step, "stream": {"position": step}}, "trainer: {}\n")


def test_save_is_atomic_and_pointed_to(tmp_path):
    ck = Checkpoints(tmp_path, keep=2)
    path = save(ck, 2)
    assert path.name == "step_000002" and (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["actor/weights.bin"] == {"bytes": 100, "sha256": hashlib.sha256(b"x" * 100).hexdigest()}
    assert "driver.pt" in manifest
    found, driver = ck.latest()
    assert found == path and driver["step"] == 2


def test_half_written_checkpoint_is_never_latest(tmp_path):
    ck = Checkpoints(tmp_path)
    save(ck, 2)
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir()  # the process died while writing it
    assert ck.latest()[1]["step"] == 2
    assert [p.name for p in ck.complete()] == ["step_000002"]


def test_corrupt_or_missing_falls_back_with_a_message(tmp_path, capsys):
    ck = Checkpoints(tmp_path, keep=3)
    save(ck, 2)
    newest = save(ck, 4)
    (newest / "actor" / "weights.bin").write_bytes(b"x" * 10)  # truncated
    path, driver = ck.latest()
    assert driver["step"] == 2
    assert "step_000004/actor/weights.bin has 10 bytes, the manifest says 100" in capsys.readouterr().out
    (tmp_path / "checkpoints" / "latest").write_text("step_000009")  # points at nothing
    assert ck.latest()[1]["step"] == 2
    assert "named by 'latest' but missing" in capsys.readouterr().out


def test_keeps_the_last_k(tmp_path):
    ck = Checkpoints(tmp_path, keep=2)
    for step in (2, 4, 6):
        save(ck, step)
    assert [p.name for p in ck.complete()] == ["step_000006", "step_000004"]


def test_driver_state_loads_with_weights_only(tmp_path):
    ck = Checkpoints(tmp_path)
    import random

    rng = random.Random(3)
    ck.save(1, write_roles, {"step": 1, "stream": {"rng": rng.getstate(), "order": [3, 1], "position": 5}}, "")
    driver = torch.load(tmp_path / "checkpoints" / "step_000001" / "driver.pt", weights_only=True)
    assert driver["stream"]["order"] == [3, 1]


def test_begun_checkpoint_counts_only_once_committed(tmp_path):
    """An async save: the workers' files are still being written between begin and commit."""
    ck = Checkpoints(tmp_path)
    save(ck, 2)
    tmp = ck.begin(4, write_roles, {"step": 4, "stream": {"position": 4}}, "trainer: {}\n")
    assert tmp.name == "step_000004.tmp" and ck.latest()[1]["step"] == 2
    (tmp / "actor" / "late.bin").write_bytes(b"y" * 7)  # finished after begin returned
    path = ck.commit(tmp)
    assert ck.latest()[0] == path and json.loads((path / "manifest.json").read_text())["actor/late.bin"]["bytes"] == 7


def test_flipped_bytes_fall_back_and_sizes_only_manifests_are_accepted_with_a_warning(tmp_path, capsys):
    ck = Checkpoints(tmp_path, keep=3)
    save(ck, 2)
    newest = save(ck, 4)
    (newest / "actor" / "weights.bin").write_bytes(b"x" * 50 + b"y" + b"x" * 49)  # same size
    assert ck.latest()[1]["step"] == 2
    assert f"{newest}/actor/weights.bin does not match its sha256" in capsys.readouterr().out
    manifest = newest / "manifest.json"  # as megarl wrote it before hashes: sizes only
    manifest.write_text(json.dumps({name: entry["bytes"] for name, entry in json.loads(manifest.read_text()).items()}))
    assert ck.latest()[1]["step"] == 4
    assert "records no content hashes" in capsys.readouterr().out


class Workers:
    """The worker group's save: the roles' files, taking ``save_s``."""

    def __init__(self, save_s: float = 0.0):
        self.save_s = save_s

    def call(self, method, path):
        assert method == "save_checkpoint"
        time.sleep(self.save_s)
        write_roles(Path(path))
        return [None]


def schedule(tmp_path, preemption, workers=None, **trainer):
    t = dataclasses.replace(TrainerConfig(), **trainer)
    return CheckpointSchedule(Checkpoints(tmp_path, t.keep_checkpoints), t, workers or Workers(),
                              lambda step: {"step": step}, "trainer: {}\n", preemption)


def test_a_run_with_the_defaults_keeps_checkpoints(tmp_path, capsys):
    """trainer.save_interval defaults to 50: a 60-step run saves steps 50 and 60 (the last), each
    save's time printed, and the default grace (300 s) fits them without a warning."""
    stop = Preemption(TrainerConfig().signal_grace_s)
    try:
        run = schedule(tmp_path, stop)
        for step in range(1, 61):
            run.after_step(step)
    finally:
        stop.close()
    assert [p.name for p in run.checkpoints.complete()] == ["step_000060", "step_000050"]
    out, err = capsys.readouterr()
    assert [line.split(" written in ")[0] for line in out.splitlines()] == [
        "megarl: checkpoint step_000050", "megarl: checkpoint step_000060"]
    assert "warning" not in err


def test_a_grace_shorter_than_a_step_and_a_save_is_warned_of_once(tmp_path, capsys):
    for work in (1.0, 80.0, 100.0, 1000.0):  # the grace asked for leaves the work a quarter to spare
        grace = grace_needed_s(work)
        assert grace - teardown_margin_s(grace) == pytest.approx(1.25 * work)
    stop = Preemption(0.1)
    try:
        run = schedule(tmp_path, stop, Workers(save_s=0.2), save_interval=1, train_steps=3, signal_grace_s=0.1)
        for step in range(1, 4):
            time.sleep(0.1)  # the step
            run.after_step(step)
    finally:
        stop.close()
    assert run.longest_step_s >= 0.1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 3 and err.count("warning") == 1, err
    assert re.match(r"megarl: warning: trainer\.signal_grace_s=0\.1 s is short: a SIGTERM waits for the step in "
                    r"progress \(the longest so far took 0\.0 s\) and its checkpoint \(this one took \d+\.\d s\)", err), err
    assert err.rstrip().endswith("Set trainer.signal_grace_s=10 or more, and under launch/slurm/train.sbatch "
                                 "sbatch --signal=B:TERM@70"), err


def test_ranks_lost_to_a_sigterm_end_the_run_as_preempted(tmp_path):
    """Slurm's preemption signals every step: the ranks die beside the driver, whose SIGTERM may come
    just before or just after it finds them dead. Without a SIGTERM a lost rank stays the error."""
    lost = WorkerDied("rank 1 (pid 7 on node 10.0.0.2) died (Ray node 1234abcd): ActorDiedError")
    stop = Preemption(30)
    sigterm = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))  # just after the rank's death
    try:
        run = schedule(tmp_path, stop, save_interval=2)
        with pytest.raises(WorkerDied):
            with run.running():
                raise lost
        run.after_step(2)
        with pytest.raises(Preempted) as caught:
            with run.running():
                sigterm.start()
                raise lost
    finally:
        sigterm.cancel()
        sigterm.join()
        stop.close()
    assert str(caught.value) == (
        f"SIGTERM, then the step in progress failed (WorkerDied: {lost}): Slurm's preemption and a plain scancel "
        "signal every step of the job, the ranks' too; the step is lost, the newest checkpoint is "
        f"{tmp_path / 'checkpoints' / 'step_000002'}: the requeued job or a rerun resumes from it")
