"""Where SGLang's engines run and how they meet the trainer, without GPUs: the node ids of a
worker's GPUs, the devices one engine spans (one host, one GPU per TP rank), the environment its
processes start with, the workers' NCCL setting, the checked SGLang versions of the weights group's
rendezvous, the GPUs each worker asks Ray for, and the mem_fraction_static key."""

from __future__ import annotations

import os

import pytest

from megarl.config import ConfigError
from megarl.config.schema import RolloutLayoutConfig
from megarl.controller.group import gpu_assignment
from megarl.rollout.engine_files import engine_env
from megarl.rollout.sglang_engine import (check_engine_devices, engine_environment, physical_device, release_tuple,
                                          rendezvous_warning, worker_env)


def test_physical_device_reads_the_visible_list():
    assert physical_device(None, 3) == "3"  # torchrun: every GPU visible, LOCAL_RANK's
    assert physical_device("5", 0) == "5"  # a Ray worker: its one GPU
    assert physical_device("4, 6", 1) == "6"
    assert physical_device("GPU-1a2b,GPU-3c4d", 1) == "GPU-3c4d"  # UUIDs pass through
    with pytest.raises(ValueError, match="CUDA device 1 is not among"):
        physical_device("5", 1)


def test_engine_spans_its_tp_ranks_gpus_on_one_host():
    assert check_engine_devices([("n0", "2"), ("n0", "3")]) == ["2", "3"]
    with pytest.raises(ValueError, match="spans hosts"):
        check_engine_devices([("n0", "0"), ("n1", "0")])
    with pytest.raises(ValueError, match="share GPUs"):
        check_engine_devices([("n0", "0"), ("n0", "0")])  # the old fractional GPUs of split placement


def test_engine_environment_is_set_for_the_engine_then_restored(monkeypatch):
    """The engine's GPUs visible, torchrun's agent-store flag unset while it starts; this
    process's environment back afterwards, also when the start fails."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with engine_env(engine_environment(["1", "2"])):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,2" and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    with pytest.raises(KeyError), engine_env(engine_environment(["0"])):
        raise KeyError("the engine failed to start")
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


def test_workers_take_sglangs_nccl_cumem_setting(monkeypatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert worker_env() == {"NCCL_CUMEM_ENABLE": "0"}  # what SGLang sets when it is unset
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    assert worker_env() == {"NCCL_CUMEM_ENABLE": "1"}  # SGLang keeps a set value: so do the trainer's ranks


def test_rendezvous_checked_versions():
    assert release_tuple("0.5.6.post2") == (0, 5, 6) and release_tuple("0.5.23+cu129") == (0, 5, 23)
    assert rendezvous_warning("0.5.6.post2") is None and rendezvous_warning("0.5.23") is None
    assert "must join it" in rendezvous_warning("0.6.0") and "0.5.6..0.5.23" in rendezvous_warning("0.4.10")


def test_gpus_come_from_the_ray_cluster():
    assert gpu_assignment(0, 4) == (0, "the Ray cluster has no GPUs: workers on CPU (gloo)")
    gpus, why = gpu_assignment(8, 4, "sglang")
    assert gpus == 1 and "8 GPUs: one per rank (4 ranks)" in why
    with pytest.raises(ConfigError, match="2 ranks .* the Ray cluster has 1;"):
        gpu_assignment(1, 2)  # one-GPU split placement: two ranks of one NCCL group on one GPU
    with pytest.raises(ConfigError, match="engine=sglang needs GPUs"):
        gpu_assignment(0, 1, "sglang")


def test_mem_fraction_static_is_a_bounded_key():
    from megarl.config.loader import load_config

    assert RolloutLayoutConfig().mem_fraction_static == 0.5
    cfg = load_config(["configs/grpo_demo.yaml"], ["parallel.rollout.mem_fraction_static=0.7"])
    assert cfg.parallel.rollout.mem_fraction_static == 0.7
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        load_config(["configs/grpo_demo.yaml"], ["parallel.rollout.mem_fraction_static=1.5"])
