"""Engine log-probs (vocabulary-parallel, through Megatron's pipeline schedule) equal
log_softmax of the single-process model's logits at every layout, with fixed or token-budget
micro-batches, padded or packed; max abs diff <= 1e-5 on real tokens, zeros past them."""

import json

import pytest

from tests.distributed.launch import torchrun

WORKER = "tests/distributed/engine_worker.py"
# name@t,p,d,e[:micro-batching]; padded fixed-size micro-batches unless said otherwise
SPECS = {1: ["dense@1,1,1,1", "moe@1,1,1,1", "dense@1,1,1,1:dynamic", "dense@1,1,1,1:packed"],
         2: ["dense@2,1,1,1", "dense@1,2,1,1", "dense@1,1,2,1", "moe@2,1,1,1", "moe@1,2,1,1", "moe@1,1,2,2",
             "dense@2,1,1,1:dynamic-packed", "dense@1,2,1,1:dynamic", "moe@1,1,2,2:packed", "dense@1,2,1,1:packed",
             "dense@1,2,1,1,2", "dense@1,2,1,1,2:dynamic-packed"],  # ,2 = two virtual pipeline stages
         4: ["dense@2,2,1,1", "moe@2,2,1,1", "dense@2,2,1,1:dynamic-packed"]}
# updates with a NaN on one rank, in the two-process session: dp=2 (distributed optimizer), pp=2
NONFINITE = ["nonfinite@1,1,2,1", "nonfinite@1,2,1,1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("engine")
    torchrun(1, WORKER, "reference", str(work))
    found = []
    for world, specs in SPECS.items():
        out = torchrun(world, WORKER, "run", str(work), *specs, *(NONFINITE if world == 2 else []))
        found += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return found


def test_engine_log_probs_match_single_process_log_softmax(results):
    log_probs = [r for r in results if r["spec"] not in NONFINITE]
    assert {r["spec"] for r in log_probs} == {s for specs in SPECS.values() for s in specs}
    bad = {r["spec"]: r["max_abs_diff"] for r in log_probs if not r["max_abs_diff"] <= 1e-5}
    assert not bad, bad


def test_non_finite_update_is_skipped_on_every_rank(results):
    """A NaN gradient or loss on rank 1 only: every rank skips the step (weights and optimizer
    state bit-identical), counts it, and the third bad step in a row raises NonFiniteUpdateError."""
    got = {r["spec"]: r for r in results if r["spec"] in NONFINITE}
    assert set(got) == set(NONFINITE)
    assert all(r["nonfinite_ok"] == 1.0 for r in got.values()), got
