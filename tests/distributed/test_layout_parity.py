"""Layout parity: the same tiny dense and MoE models, batch and seed give the same loss and
gradients at every layout, and the same losses and weights after 3 steps with the distributed
optimizer. Tolerance: relative difference <= 1e-5 in fp32 (norm of difference / norm of the
single-process value, per tensor; the worst tensor is reported).

Every layout loads the initial weights the single-process run wrote (a Megatron dist
checkpoint), and saves its reduced gradients and final weights the same way, so they are read
back as whole tensors whatever the layout.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import torchrun

TOL = 1e-5
# (t, p, d, e[, vpp]); e=2 runs for MoE only; 1,2,1,1,2 = two virtual pipeline stages per rank
LAYOUTS_2 = ["2,1,1,1", "1,2,1,1", "1,1,2,1", "1,1,2,2", "1,2,1,1,2"]
LAYOUTS_4 = ["2,2,1,1"]
EXPECTED = {
    "dense": {"t1p1d1e1", "t2p1d1e1", "t1p2d1e1", "t1p1d2e1", "t2p2d1e1", "t1p2d1e1v2"},
    "moe": {"t1p1d1e1", "t2p1d1e1", "t1p2d1e1", "t1p1d2e1", "t1p1d2e2", "t2p2d1e1", "t1p2d1e1v2"},
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("parity")
    worker = "tests/distributed/parity_worker.py"
    torchrun(1, worker, "run", "--workdir", str(work), "--reference")
    torchrun(2, worker, "run", "--workdir", str(work), "--layouts", *LAYOUTS_2)
    torchrun(4, worker, "run", "--workdir", str(work), "--layouts", *LAYOUTS_4)
    torchrun(1, worker, "compare", "--workdir", str(work), "--report", str(work / "report.json"))
    return json.loads((work / "report.json").read_text())


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_every_layout_ran(report, model):
    ran = {key.split("/")[1] for key in report if key.startswith(model + "/")}
    assert ran == EXPECTED[model]


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("metric", ["loss", "grads", "step_losses", "grad_norms", "weights"])
def test_layout_matches_single_process(report, model, metric):
    worst = {key: entry[metric] for key, entry in report.items() if key.startswith(model + "/")}
    bad = {key: value for key, value in worst.items() if not value <= TOL}
    assert not bad, f"{metric} differs from the single-process run by more than {TOL}: {bad}"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_every_tensor_got_a_gradient(report, model):
    counts = {key: entry["grads_nonzero"] for key, entry in report.items() if key.startswith(model + "/")}
    assert len(set(counts.values())) == 1 and min(counts.values()) > 20, counts
