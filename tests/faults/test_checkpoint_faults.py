"""Faults in a run's checkpoints (issue 15): a file with 64 bytes flipped at the same size, and a
crafted dist-checkpoint ``.metadata`` whose pickle would create a file when unpickled.

One small run (4 steps, checkpoints at 2 and 4) is shared by the module; each case damages its
own copy. Flipped bytes: resume reports the file and continues from step 2 exactly as the
uninterrupted run did; ``export-hf`` and ``convert`` refuse with exit 2 naming the file.
Crafted metadata: every reader (resume's choice, export-hf, convert, ``model.path``) refuses
with the file and the class named, and the payload's file is never created."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from megarl.checkpoint.hf_io import CheckpointFileError
from megarl.checkpoint.integrity import file_digest, load_dist_metadata
from megarl.trainer.checkpoint import Checkpoints
from tests.distributed.launch import ROOT

ARGS = ["configs/grpo_demo.yaml", "trainer.save_interval=2", "logging.progress_bar=false",
        "data.prompts_per_step=4", "algorithm.samples_per_prompt=4"]
COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/clip_frac", "response/length_mean")


def megarl(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled")
    return subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ckpt_faults") / "run"
    done = megarl("train", *ARGS, "trainer.train_steps=4", f"trainer.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004"]
    return run_dir


def copy_run(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def flip_64_bytes(file):
    data = bytearray(file.read_bytes())
    start = len(data) // 2
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    file.write_bytes(bytes(data))  # same size: the size check of before sees nothing


class CreateFile:
    """Unpickled by a plain ``pickle.load``, this calls ``open(path, 'w')``: the file appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def craft_metadata(actor_dir, marker, update_manifest):
    """Replace ``actor_dir/.metadata`` with a payload of the same size (pickle stops reading at
    its STOP opcode; the rest is padding); with ``update_manifest`` also record its new hash,
    as whoever crafts a checkpoint can."""
    file = actor_dir / ".metadata"
    size = file.stat().st_size
    payload = pickle.dumps(CreateFile(marker))
    assert len(payload) < size
    file.write_bytes(payload + b"\0" * (size - len(payload)))
    if update_manifest:
        manifest_file = actor_dir.parent / "manifest.json"
        manifest = json.loads(manifest_file.read_text())
        manifest["actor/.metadata"]["sha256"] = file_digest(file)
        manifest_file.write_text(json.dumps(manifest))
    return file


def test_flipped_bytes_resume_uses_the_previous_checkpoint(run, tmp_path):
    run_dir = copy_run(run, tmp_path)
    step4 = run_dir / "checkpoints" / "step_000004"
    damaged = max((step4 / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    flip_64_bytes(damaged)

    done = megarl("train", *ARGS, "trainer.train_steps=5", f"trainer.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{damaged} does not match its sha256" in done.stdout, done.stdout[-3000:]
    assert "resuming after step 2" in done.stdout
    ours, before = metrics(run_dir), metrics(run)
    assert [r["step"] for r in ours] == [1, 2, 3, 4, 5]  # a resumed run keeps the metrics up to its step
    for again, first in zip(ours[2:4], before[2:4]):  # resumed from step 2: the same steps 3 and 4
        assert {k: again[k] for k in COMPARED} == {k: first[k] for k in COMPARED}, again["step"]


def test_flipped_bytes_export_and_convert_refuse(run, tmp_path):
    run_dir = copy_run(run, tmp_path)
    step4 = run_dir / "checkpoints" / "step_000004"
    damaged = step4 / "actor" / "__0_0.distcp"
    flip_64_bytes(damaged)

    export = megarl("export-hf", run_dir, tmp_path / "hf")
    assert export.returncode == 2, export.stderr[-3000:]
    assert f"{damaged} does not match its sha256" in export.stderr and "step_000002" in export.stderr
    assert "Traceback" not in export.stderr
    convert = megarl("convert", "mcore-to-hf", step4 / "actor", tmp_path / "hf2", "--hf-config", tmp_path)
    assert convert.returncode == 2 and f"{damaged} does not match its sha256" in convert.stderr, convert.stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf2").exists()


def test_crafted_metadata_runs_nothing(run, tmp_path, capsys):
    run_dir = copy_run(run, tmp_path)
    step4 = run_dir / "checkpoints" / "step_000004"
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(CreateFile(marker))).close()  # the payload works when unpickled plainly
    assert marker.exists()
    marker.unlink()

    crafted = craft_metadata(step4 / "actor", marker, update_manifest=False)
    export = megarl("export-hf", run_dir, tmp_path / "hf")  # the hash catches it first
    assert export.returncode == 2 and f"{crafted} does not match its sha256" in export.stderr, export.stderr

    craft_metadata(step4 / "actor", marker, update_manifest=True)  # hashes agree: the allow-list refuses
    refused = f"{crafted}: refused to unpickle io.open"  # how pickle names the builtin open
    with pytest.raises(CheckpointFileError, match="refused to unpickle io.open"):
        load_dist_metadata(step4 / "actor")
    path, driver = Checkpoints(run_dir).latest()  # resume's choice
    assert path.name == "step_000002" and driver["step"] == 2
    assert refused in capsys.readouterr().out
    for args in (("export-hf", run_dir, tmp_path / "hf"),
                 ("convert", "mcore-to-hf", step4 / "actor", tmp_path / "hf2", "--hf-config", tmp_path)):
        proc = megarl(*args)
        assert proc.returncode == 2 and refused in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

    from megarl.checkpoint.load import check_pretrained
    from megarl.config import load_config
    from megarl.models.hf_mapping import ConversionError

    model_cfg = load_config([step4 / "config.yaml"]).model
    with pytest.raises(ConversionError, match="refused to unpickle io.open"):
        check_pretrained(step4 / "actor", model_cfg)
    assert not marker.exists()
