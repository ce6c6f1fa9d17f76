"""Runtime on CPU under torchrun: process groups match the layout's rank arithmetic, impossible
layouts are refused before any group exists, every architecture trains, packed sequences match."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import torchrun

WORKER = "tests/distributed/runtime_worker.py"
# name@t,p,d,e,vpp (vpp 0 = none)
ARCH_SPECS = ["tiny-llama@2,1,1,1,0", "tiny-qwen2@1,2,1,1,2", "tiny-qwen3@2,1,1,1,0",
              "tiny-qwen3-moe@2,1,1,1,0", "tiny-qwen3-moe@1,1,2,2,0", "tiny-mixtral@1,2,1,1,0",
              "tiny-mixtral@2,1,1,2,0", "tiny-deepseek-v3@2,1,1,1,0", "tiny-deepseek-v3@1,1,2,2,0"]


def results(output: str):
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def group_results():
    return results(torchrun(4, WORKER, "groups"))


def test_groups_match_layout_coordinates(group_results):
    checked = [r for r in group_results if r["check"] == "groups"]
    assert len(checked) == 4 and all(r["ok"] for r in checked), checked


def test_impossible_layout_refused_before_any_group(group_results):
    (refused,) = [r for r in group_results if r["check"] == "refuse"]
    assert "world size 4" in refused["message"] and "3" in refused["message"]
    assert refused["no_groups"]


def test_the_collector_leaves_start_up_and_exit_alone(group_results):
    """megarl.runtime.settle_collector: a rank's import-time objects (torch, Megatron: some 300k)
    are frozen at init_distributed, out of every later full collection; at exit all are, before
    Python's last collection."""
    (start,) = [r for r in group_results if r["check"] == "collector"]
    (end,) = [r for r in group_results if r["check"] == "collector_at_exit"]
    assert start["frozen"] > 100_000, start
    assert end["frozen"] >= start["frozen"] and end["tracked"] < 1_000, end


def test_every_architecture_trains():
    runs = results(torchrun(2, WORKER, "archs", *ARCH_SPECS))
    assert len(runs) == len(ARCH_SPECS)
    for run in runs:
        losses = run["losses"]
        assert all(0 < loss < 10 for loss in losses), run
        assert losses[-1] < losses[0] - 0.5, run  # same batch four times: the loss must fall


@pytest.fixture(scope="module")
def single_results():
    return results(torchrun(1, WORKER, "single"))


def test_packed_sequences_equal_separate_sequences(single_results):
    runs = [r for r in single_results if r["check"] == "packed"]
    assert {r["model"] for r in runs} == {"tiny-qwen3", "tiny-deepseek-v3"}
    for run in runs:
        assert run["max_abs_diff"] <= 1e-5, run


def test_rotary_frequencies_match_transformers(single_results):
    runs = {r["rope"]: r["max_abs_diff"] for r in single_results if r["check"] == "rope"}
    assert set(runs) == {"default", "llama3"}
    assert all(diff <= 1e-7 for diff in runs.values()), runs
