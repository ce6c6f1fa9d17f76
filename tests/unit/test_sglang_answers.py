"""SGLang answers a failed weight update with ``(False, message)`` rather than raising (0.5.6.post2:
the model runner catches the loader's exception for ``update_weights_from_distributed`` and
``init_weights_update_group``; ``flush_cache`` answers ``success=False`` while requests run). The
SGLang rollout checks every answer and raises with the call, the rank and SGLang's message. An
engine stand-in with scripted answers, driven through ``SGLangRollout`` and its two transports;
no GPU, no processes. The engine's environment drops torchrun's agent-store flag."""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from megarl.parallel import Layout
from megarl.rollout import sglang_engine
from megarl.rollout.sglang_engine import SGLangRollout
from megarl.transports.nccl_broadcast import BroadcastReceiver

RANK = 3  # this process's rank in the run, as the error must name it


@dataclass
class FlushCacheReqOutput:  # sglang.srt.managers.io_struct (0.5.6.post2)
    success: bool


OK = {"update_weights_from_tensor": (True, "Success"), "update_weights_from_distributed": (True, "Succeeded"),
      "init_weights_update_group": (True, "Succeeded to initialize custom process group."),
      "flush_cache": FlushCacheReqOutput(True), "release_memory_occupation": None, "resume_memory_occupation": None}


class ScriptedEngine:
    """Answers each call as scripted in ``answers`` (method -> answer) and records the environment
    its processes would inherit."""

    answers: dict = {}

    def __init__(self, **kwargs):
        self.env = dict(os.environ)

    def __getattr__(self, method):
        if method not in OK:
            raise AttributeError(method)
        return lambda *args, **kwargs: self.answers.get(method, OK[method])


class _Group:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


class TensorTransport:
    """The colocated hand-over's calls (cuda_ipc.CudaIpcSender.sync), without tensors."""

    in_process = False  # keep the constructor from releasing memory

    def sync(self, engine):
        engine.update_weights_from_tensor(named_tensors=[], flush_cache=False)
        engine.flush_cache()


@pytest.fixture
def rollout(monkeypatch):
    def build(answers, weights=None):
        ScriptedEngine.answers = answers
        module = types.ModuleType("sglang")
        module.Engine, module.__version__ = ScriptedEngine, "0.5.6.post2"
        monkeypatch.setitem(sys.modules, "sglang", module)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(sglang_engine, "engine_devices", lambda group: ["2", "5"])
        monkeypatch.setattr(dist, "get_rank", lambda group=None: RANK)
        monkeypatch.setattr(dist, "barrier", lambda group=None: None)
        groups = types.SimpleNamespace(layout=Layout(tp=2, dp=2), pg=types.SimpleNamespace(tp=_Group(0), dp=_Group(1)))
        return SGLangRollout(groups, None, "/nonexistent", torch.bfloat16, weights or TensorTransport())

    return build


@pytest.mark.parametrize("method, answer, message", [
    ("update_weights_from_tensor", (False, "Failed to update weights: size mismatch for lm_head.weight"),
     "size mismatch for lm_head.weight"),
    ("flush_cache", FlushCacheReqOutput(False), "requests"),
])
def test_a_failed_colocated_sync_raises_with_the_call_rank_and_message(rollout, method, answer, message):
    engine = rollout({method: answer})
    with pytest.raises(RuntimeError, match=rf"SGLang's Engine\.{method} failed on rank {RANK}\b.*{message}"):
        engine.update_weights(1)


@pytest.mark.parametrize("method, answer", [
    ("init_weights_update_group", (False, "Failed to initialize custom process group: timed out")),
    ("update_weights_from_distributed", (False, "Failed to update parameter online: dtype mismatch")),
])
def test_a_failed_split_sync_raises_with_the_call_rank_and_message(rollout, method, answer):
    groups = types.SimpleNamespace(layout=Layout(tp=2, dp=2), pg=types.SimpleNamespace(dp=_Group(1)))
    engine = rollout({method: answer}, BroadcastReceiver([], groups))
    with pytest.raises(RuntimeError, match=rf"SGLang's Engine\.{method} failed on rank {RANK}\b.*{answer[1]}"):
        engine.connect_weights("127.0.0.1", 29555)
        engine.weights.plan = [types.SimpleNamespace(tensors=[], nbytes=0)]  # one (empty) bucket
        engine.update_weights(1)


def test_successful_answers_pass(rollout):
    engine = rollout({})
    engine.update_weights(1)
    engine.release_memory()
    engine.resume_memory()
    assert engine.policy_version == 1


def test_the_engine_starts_without_torchruns_agent_store(rollout, monkeypatch):
    """torchrun's agent exports TORCHELASTIC_USE_AGENT_STORE=True; torch's rendezvous then makes
    every rank a store client (torch/distributed/rendezvous.py), and SGLang's schedulers, which
    meet on a port of their own, would wait for a store nobody hosts."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    engine = rollout({})
    assert "TORCHELASTIC_USE_AGENT_STORE" not in engine.engine.env
    assert engine.engine.env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True" and os.environ["CUDA_VISIBLE_DEVICES"] == "2"
