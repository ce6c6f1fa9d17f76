"""Offload of params, grads and optimizer state to host memory and back (all at once, each kind
alone, and through the RL loop's PhaseOffload): the device storages are really freed, come back
bit-identical, and training continues bit-identically to a state that never moved (dense with
the distributed optimizer at d=2, MoE at e=2, dense at t=2)."""

import json

from tests.distributed.launch import torchrun


def test_offload_round_trip_is_bit_exact():
    out = torchrun(2, "tests/distributed/offload_worker.py")
    records = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(records) == 3
    for r in records:
        assert r["freed"] and r["restored"] and r["same_after_training"] and r["all_ranks_ok"], r
        assert r["losses"][0] == r["losses"][1] and r["offloaded_mb"] > 0.5, r
        assert r["kinds_ok"] == {"params": True, "grads": True, "optimizer": True}, r
        assert r["phase_freed"] and r["resident"], r
        # the first sync closes no phase; later ones report both phases' peaks (max over ranks)
        assert sorted(r["first_metrics"]) == ["time/offload_s"], r
        m = r["phase_metrics"]
        assert sorted(m) == ["memory/host_peak_gb/generate", "memory/host_peak_gb/train", "time/offload_s",
                             "time/reload_s"], r
        assert all(0 < v < 64 for v in m.values()), m
