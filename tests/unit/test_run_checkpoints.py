"""Run checkpoints on disk: atomic rename and `latest` pointer, half-written directories never
used, a corrupt or missing checkpoint reported and the previous one used, the last k kept."""

import hashlib
import json

import torch

from megarl.trainer.checkpoint import Checkpoints


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
