"""Update invariance: one actor update (PPO with clip-higher, clipping engaged, + k3 KL loss +
entropy bonus), or one critic update (clipped value loss, value head), from the same weights and
batch gives the same gradients and new weights at every layout, with fixed or token-budget
micro-batches, padded or packed sequences, dense and MoE (e=2); relative difference (norm of
difference / norm) <= 1e-5 per tensor, fp32."""

import json

import pytest

from tests.distributed.launch import torchrun

WORKER = "tests/distributed/actor_worker.py"
TOL = 1e-5
REFERENCES = ["dense@1,1,1,1", "moe@1,1,1,1", "critic@1,1,1,1"]
SPECS = {
    1: ["dense@1,1,1,1:dynamic", "dense@1,1,1,1:packed"],
    2: ["dense@2,1,1,1", "dense@1,2,1,1", "dense@1,1,2,1", "dense@1,2,1,1:packed", "dense@1,1,2,1:dynamic",
        "dense@2,1,1,1:dynamic-packed", "moe@2,1,1,1", "moe@1,1,2,2", "moe@1,1,2,2:packed",
        "critic@2,1,1,1", "critic@1,2,1,1:packed", "critic@1,1,2,1:dynamic",
        "dense@1,2,1,1,2", "critic@1,2,1,1,2:packed"],  # ,2 = two virtual pipeline stages
    4: ["dense@2,2,1,1", "dense@2,2,1,1:dynamic-packed", "moe@2,2,1,1", "critic@2,2,1,1"],
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    work = tmp_path_factory.mktemp("actor")
    torchrun(1, WORKER, "reference", str(work), *REFERENCES)
    for world, specs in SPECS.items():
        torchrun(world, WORKER, "run", str(work), *specs)
    out = torchrun(1, WORKER, "compare", str(work))
    return [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]


def test_every_run_compared(records):
    assert len(records) == len(REFERENCES) + sum(len(s) for s in SPECS.values())


def test_the_update_exercises_clipping(records):
    assert all(0.05 < r["clip_frac"] < 0.95 for r in records)


@pytest.mark.parametrize("metric", ["loss", "grads", "weights"])
def test_update_is_layout_and_batching_invariant(records, metric):
    bad = {r["run"]: r[metric] for r in records if not r[metric] <= TOL}
    assert not bad, f"{metric} differs from the single-process update by more than {TOL}: {bad}"
