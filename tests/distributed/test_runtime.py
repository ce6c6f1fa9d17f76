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
    with pytest.MonkeyPatch.context() as env:  # groups connected lazily keep torch's own gloo devices
        env.setenv("TORCH_GLOO_LAZY_INIT", "1")
        return results(torchrun(4, WORKER, "groups"))


@pytest.fixture(scope="module")
def arch_results():
    with pytest.MonkeyPatch.context() as env:  # torch's other way to pick gloo's devices
        env.setenv("GLOO_SOCKET_IFNAME", "lo")
        return results(torchrun(2, WORKER, "archs", *ARCH_SPECS))


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


def test_every_architecture_trains(arch_results):
    runs = [r for r in arch_results if r["check"] == "arch"]
    assert len(runs) == len(ARCH_SPECS)
    for run in runs:
        losses = run["losses"]
        assert all(0 < loss < 10 for loss in losses), run
        assert losses[-1] < losses[0] - 0.5, run  # same batch four times: the loss must fall


def test_a_rank_runs_one_gloo_transport_thread_for_all_its_groups(group_results, arch_results, single_results):
    """megarl.runtime.distributed.share_gloo_device: torch would give each of Megatron's groups a
    gloo device of its own, each with a thread that wakes every 10 ms (400 threads for 8 ranks).
    Under TORCH_GLOO_LAZY_INIT it keeps torch's devices (lazily connected pairs on a shared device
    hung), and the groups session's collectives still pass (test_groups_match_layout_coordinates)."""
    loops = [r for r in group_results + arch_results + single_results if r["check"] == "gloo_loops"]
    assert len(loops) == 4 + len(ARCH_SPECS) + 1, loops
    shared = [r for r in loops if not r["lazy"]]
    assert len(shared) == len(ARCH_SPECS) + 1 and all(r["loops"] == 1 for r in shared), loops
    assert {r["ifname"] for r in shared} == {"lo", ""} and all(r["groups"] >= 10 for r in loops), loops
    assert all(r["loops"] > 1 for r in loops if r["lazy"]), loops


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


PROBE = "tests/distributed/launch_probe.py"


def probes(output: str):
    return sorted((json.loads(line[len("PROBE "):]) for line in output.splitlines() if line.startswith("PROBE ")),
                  key=lambda p: p["rank"])


@pytest.mark.parametrize("fork", ["1", "0"])
def test_the_launchers_ranks_are_processes_as_a_new_interpreter_starts_them(monkeypatch, fork):
    """tests/distributed/launch.py: forked from the suite's fork server (its imports done) or
    started as new interpreters (MEGARL_TEST_FORK=0), a rank is its own process with the script as
    ``__main__``, its argv and ``sys.path[0]``, the root as its directory, no stdin, rank 0 holding
    the launcher's store socket; and a rank's exit code or signal comes back as Popen gives it."""
    import os

    from tests.distributed.launch import ROOT

    monkeypatch.setenv("MEGARL_TEST_FORK", fork)
    ranks = probes(torchrun(2, PROBE, "0"))
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks} | {os.getpid()}) == 3
    assert {r["torch_preloaded"] for r in ranks} == {fork == "1"}
    assert {r["ppid"] == os.getpid() for r in ranks} == {fork == "0"}  # forked: the server's children
    for r in ranks:
        assert r["argv"] == [str(ROOT / PROBE), "0"] and r["path0"] == str(ROOT / "tests/distributed"), r
        assert r["name"] == "__main__" and r["stdin"] == "" and r["cwd"] == str(ROOT) and r["omp"] == "1", r
    assert ranks[0]["store_port"] == ranks[0]["master_port"] and ranks[1]["store_port"] is None
    for code, shown in (("3", "{1: 3}"), ("kill", "{1: -9}")):
        with pytest.raises(AssertionError, match=f"exit codes by rank {shown}"):
            torchrun(2, PROBE, code)


def test_an_import_time_variable_of_its_own_gets_the_ranks_a_server_started_with_it(monkeypatch):
    """A variable read when torch is imported, set otherwise than the fork server's: the ranks are
    forked from a new server that imported torch with it; back to the suite's environment, another."""
    def servers():
        ranks = probes(torchrun(2, PROBE, "0"))
        assert all(r["torch_preloaded"] for r in ranks) and len({r["ppid"] for r in ranks}) == 1, ranks
        environ = open(f"/proc/{ranks[0]['ppid']}/environ", "rb").read().split(b"\0")
        return ranks[0]["ppid"], b"TORCH_SHOW_CPP_STACKTRACES=1" in environ

    before = servers()
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    during = servers()
    assert during[1] is True and during[0] != before[0]
    monkeypatch.delenv("TORCH_SHOW_CPP_STACKTRACES")
    after = servers()
    assert after[1] is False and after[0] != before[0]
