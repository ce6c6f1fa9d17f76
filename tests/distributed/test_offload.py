"""Offload of params, grads and optimizer state to host memory and back: the device storages
are really freed, come back bit-identical, and training continues bit-identically to a state
that never moved (dense with the distributed optimizer at d=2, MoE at e=2, dense at t=2)."""

import json

from tests.distributed.launch import torchrun


def test_offload_round_trip_is_bit_exact():
    out = torchrun(2, "tests/distributed/offload_worker.py")
    records = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(records) == 3
    for r in records:
        assert r["freed"] and r["restored"] and r["same_after_training"] and r["all_ranks_ok"], r
        assert r["losses"][0] == r["losses"][1] and r["offloaded_mb"] > 0.5, r
