"""Checkpoint integrity: manifests with SHA-256, and dist-checkpoint metadata read through an
allow-list that reads torch's own files as torch does and refuses anything else unrun."""

import hashlib
import json
import pickle

import pytest
import torch

from megarl.checkpoint.hf_io import CheckpointFileError
from megarl.checkpoint.integrity import (
    load_dist_metadata, manifest_root, safe_reader, verify_manifest, weights_only_loads, write_manifest,
)


def dist_checkpoint(path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5, dtype=torch.float64)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_metadata_reads_as_torch_reads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = dist_checkpoint(tmp_path)
    ours, torchs = load_dist_metadata(tmp_path), dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
    dest = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.float64)}
    dcp.load(dest, storage_reader=safe_reader(tmp_path), no_dist=True)
    assert all(torch.equal(dest[k], state[k]) for k in state)


class CreateFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    dist_checkpoint(tmp_path)
    marker = tmp_path / "created"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(CreateFile(marker)))
    with pytest.raises(CheckpointFileError, match=r"\.metadata: refused to unpickle io\.open"):
        load_dist_metadata(tmp_path)
    with pytest.raises(CheckpointFileError, match="refused to unpickle io.open"):
        safe_reader(tmp_path).read_metadata()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointFileError, match="holds a dict, not torch's checkpoint Metadata"):
        load_dist_metadata(tmp_path)
    assert not marker.exists()


def test_weights_only_loads_override_an_explicit_weights_only_false(tmp_path):
    marker = tmp_path / "created"
    torch.save(CreateFile(marker), tmp_path / "obj.pt")
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "obj.pt", weights_only=False)  # what torch's planner does for pickled objects
    assert not marker.exists()


def test_manifest_hashes_and_names_the_changed_file(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "a.bin").write_bytes(b"\0" * 256)
    (tmp_path / "driver.pt").write_bytes(b"d")
    entries = write_manifest(tmp_path)
    assert entries["actor/a.bin"] == {"bytes": 256, "sha256": hashlib.sha256(b"\0" * 256).hexdigest()}
    assert json.loads((tmp_path / "manifest.json").read_text()) == entries
    assert manifest_root(tmp_path / "actor") == tmp_path and manifest_root(tmp_path.parent) is None
    verify_manifest(tmp_path)
    (tmp_path / "driver.pt").write_bytes(b"e")  # same size
    verify_manifest(tmp_path, under="actor")  # only the actor's files
    with pytest.raises(CheckpointFileError, match=r"driver\.pt does not match its sha256"):
        verify_manifest(tmp_path)


def test_manifest_takes_the_ranks_recorded_hashes_and_hashes_the_rest(tmp_path):
    from megarl.checkpoint.integrity import HASHES_DIR, record_hashes

    role = tmp_path / "actor"
    role.mkdir()
    for name, data in (("__0_0.distcp", b"a" * 100), ("__1_0.distcp", b"b" * 100), (".metadata", b"m" * 10)):
        (role / name).write_bytes(data)
    (tmp_path / "driver.pt").write_bytes(b"d")
    record_hashes(role, [role / "__0_0.distcp"], rank=0)
    record_hashes(role, [role / "__1_0.distcp"], rank=1)
    sidecar = role / HASHES_DIR / "rank_1.json"
    recorded = json.loads(sidecar.read_text())
    # a digest a rank recorded is taken as is (not recomputed): a marker digest shows it
    recorded["__1_0.distcp"]["sha256"] = "f" * 64
    sidecar.write_text(json.dumps(recorded))
    (role / "__0_0.distcp").write_bytes(b"c" * 99)  # changed after rank 0 hashed it: hashed again
    entries = write_manifest(tmp_path)
    assert not (role / HASHES_DIR).exists() and not any(HASHES_DIR in name for name in entries)
    assert sorted(entries) == ["actor/.metadata", "actor/__0_0.distcp", "actor/__1_0.distcp", "driver.pt"]
    assert entries["actor/__1_0.distcp"] == {"bytes": 100, "sha256": "f" * 64}
    assert entries["actor/__0_0.distcp"]["sha256"] == hashlib.sha256(b"c" * 99).hexdigest()
    assert entries["actor/.metadata"]["sha256"] == hashlib.sha256(b"m" * 10).hexdigest()  # no rank recorded it
    assert entries["driver.pt"]["sha256"] == hashlib.sha256(b"d").hexdigest()
