"""LoRA on Megatron (megarl.models.lora) against transformers + peft, and across layouts.

PEFT parity (one process; ``lora_worker.py peft``): a tiny Llama with a peft adapter on all seven
projections and a tiny Qwen3-MoE with one on attention (rank 8, random A and B), loaded through
``model.path`` + ``model.lora.path``: logits equal transformers + peft's (<= 1e-5 abs), the base's
logits with the adapters off equal transformers' without them, and every adapter's gradient
(summed cross-entropy) equals peft's (<= 1e-5 relative to the tensor's largest). Only adapters
train: nothing else requires a gradient.

Layouts (``lora_worker.py layouts``): the actor's PPO update from that adapter at tp2 (with and
without sequence parallelism), pp2·vpp2, dp2, cp2 (Llama) and tp2, dp2·ep2 (Qwen3-MoE), against
the single process: the reduced adapter gradients of one pass (<= 1e-5 relative per tensor), the
losses of 3 Adam steps with the distributed optimizer, and the adapters after them (<= 1e-5
relative), read back whole from the train-state checkpoints, which hold the adapters only. The
update itself (after - before) is held to 1e-4: Adam divides each element by its own gradient's
scale, so the elements whose gradients are near zero carry the layouts' fp32 rounding into the
step (measured: 3.0e-5 at cp2).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import torchrun

WORKER = "tests/distributed/lora_worker.py"
TOL, UPDATE_TOL = 1e-5, 1e-4
LAYOUTS_2 = ["llama@2,1,1,1", "llama@2,1,1,1:nosp", "llama@1,2,1,1,2", "llama@1,1,2,1", "llama@1,1,1,1,0,2",
             "qwen3_moe@1,1,2,2", "qwen3_moe@2,1,1,1"]


def results(output: str):
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora")
    peft = results(torchrun(1, WORKER, "peft", "--workdir", str(work)))
    torchrun(1, WORKER, "layouts", "--workdir", str(work), "--layouts", "llama@1,1,1,1", "qwen3_moe@1,1,1,1")
    torchrun(2, WORKER, "layouts", "--workdir", str(work), "--layouts", *LAYOUTS_2)
    layouts = results(torchrun(1, WORKER, "compare", "--workdir", str(work)))
    return {"peft": {r["model"]: r for r in peft}, "layouts": {f"{r['model']}/{r['layout']}": r for r in layouts}}


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_lora_equals_transformers_and_peft(report, model):
    r = report["peft"][model]
    assert r["adapter_effect"] > 0.1, r  # the adapter changes the logits: a test that could fail
    assert r["logits"] <= TOL, r
    assert r["base_logits"] <= TOL, r
    assert r["grads_compared"] == r["hf_lora_tensors"] == {"llama": 56, "qwen3_moe": 32}[model], r
    assert r["grads_rel"] <= TOL, r
    assert r["trainable_non_adapter"] == [] and r["frozen_in_optimizer"] == 0, r


def test_every_layout_ran(report):
    assert set(report["layouts"]) == {"llama/t2p1d1e1", "llama/t2p1d1e1nosp", "llama/t1p2d1e1v2", "llama/t1p1d2e1",
                                      "llama/t1p1d1e1c2", "qwen3_moe/t1p1d2e2", "qwen3_moe/t2p1d1e1"}


@pytest.mark.parametrize("metric,tol", [("grads_rel", TOL), ("losses_rel", TOL), ("adapters_rel", TOL),
                                        ("update_rel", UPDATE_TOL)])
def test_lora_update_equals_single_process(report, metric, tol):
    worst = {key: r[metric] for key, r in report["layouts"].items()}
    assert all(r["keys"] for r in report["layouts"].values()), "a checkpoint holds other tensors than the adapters"
    assert max(worst.values()) <= tol, worst
