"""The verbs role classes declare, how the driver's role proxy dispatches them, and how a worker
runs them (a Batch chunk in, a Batch column or metrics out), without Ray or a model."""

from __future__ import annotations

import pytest
import torch

from megarl.controller.group import RoleProxy
from megarl.controller.rl_worker import RLWorker
from megarl.protocol import Batch, Dispatch, Verb, declared_verbs, verb
from megarl.roles.actor import Actor
from megarl.roles.critic import Critic
from megarl.roles.reference import Reference
from megarl.roles.reward_model import RewardModel
from megarl.roles.rollout import Rollout


def test_role_classes_declare_their_verbs():
    dp = Dispatch.DP
    assert declared_verbs(Actor) == {"compute_log_prob": Verb(dp, output="old_log_probs"),
                                     "update": Verb(dp, optimizer_steps=True)}
    assert declared_verbs(Critic) == {"compute_values": Verb(dp, output="values"),
                                      "update": Verb(dp, optimizer_steps=True, metrics_prefix="critic/")}
    assert declared_verbs(Reference) == {"compute_log_prob": Verb(dp, output="ref_log_probs")}
    assert declared_verbs(RewardModel) == {"compute_scores": Verb(dp, output="scores")}
    assert declared_verbs(Rollout) == {name: Verb(Dispatch.ALL) for name in
                                       ("generate", "update_weights", "release_memory", "resume_memory")}


def test_a_subclass_inherits_and_redeclares():
    class Base:
        @verb(Dispatch.ALL)
        def a(self): ...

        @verb(Dispatch.ALL)
        def b(self): ...

    class Sub(Base):
        @verb(Dispatch.ONE)
        def b(self): ...

        def helper(self): ...

    assert declared_verbs(Sub) == {"a": Verb(Dispatch.ALL), "b": Verb(Dispatch.ONE)}


class RecordingGroup:
    """Stands in for a WorkerGroup: records which dispatch each proxy call took."""

    def __init__(self):
        self.calls = []

    def call_dp(self, method, batch, *lead, **kw):
        self.calls.append(("dp", method, lead, len(batch)))
        return "dp-result"

    def call_first(self, method, *args, **kw):
        self.calls.append(("all", method, args))
        return "rank-0-result"

    def call_one(self, method, *args, **kw):
        self.calls.append(("one", method, args))
        return "one-result"


def test_role_proxy_dispatches_as_declared():
    group = RecordingGroup()
    verbs = {"update": Verb(Dispatch.DP), "sync": Verb(Dispatch.ALL), "ping": Verb(Dispatch.ONE)}
    proxy = RoleProxy(group, "actor", verbs)
    batch = Batch({"tokens": torch.zeros(4, 8, dtype=torch.long)})
    assert proxy.update(batch) == "dp-result"
    assert proxy.sync(3) == "rank-0-result"
    assert proxy.ping() == "one-result"
    assert group.calls == [("dp", "call", ("actor", "update"), 4), ("all", "call", ("actor", "sync", 3)),
                           ("one", "call", ("actor", "ping"))]


def test_an_undeclared_verb_fails_at_the_driver_naming_the_role():
    proxy = RoleProxy(RecordingGroup(), "critic", declared_verbs(Critic))
    with pytest.raises(AttributeError, match=r"role 'critic' has no verb 'compute_log_prob'; "
                                             r"its verbs: compute_values, update"):
        proxy.compute_log_prob


class FakeEngine:
    routers = {}


class FakeRole:
    """Declares one verb of each shape; records what the worker handed it."""

    def __init__(self):
        self.engine, self.seen = FakeEngine(), {}

    @verb(Dispatch.DP, output="doubled")
    def double(self, tensors, lengths, how):
        self.seen = {"keys": sorted(tensors), "lengths": lengths, "how": how}
        return tensors["tokens"] * 2

    @verb(Dispatch.DP, metrics_prefix="fake/")
    def score(self, tensors, lengths, how):
        return {"loss": float(tensors["tokens"].sum())}

    @verb(Dispatch.ALL)
    def echo(self, *args, **kw):
        return args, kw

    def hidden(self):
        return "not a verb"


def worker_with(role):
    worker = RLWorker.__new__(RLWorker)  # no setup(): no process group, no model
    worker.roles, worker.how = {"fake": role}, "micro-batching"
    return worker


def test_worker_converts_a_batch_chunk_for_the_engine_and_back():
    role = FakeRole()
    worker = worker_with(role)
    tokens = torch.arange(6).reshape(2, 3)
    chunk = Batch({"tokens": tokens, "lengths": torch.tensor([3, 2]), "scores": torch.tensor([1.0, 0.0])},
                  policy_version=4)
    out = worker.call("fake", "double", chunk)
    assert isinstance(out, Batch) and list(out.tensors) == ["doubled"] and torch.equal(out["doubled"], tokens * 2)
    # [rows, seq] tensors go to the engine; per-row fields (scores, the lengths) stay behind
    assert role.seen["keys"] == ["tokens"] and torch.equal(role.seen["lengths"], torch.tensor([3, 2]))
    assert role.seen["how"] == "micro-batching"
    assert worker.call("fake", "score", chunk) == {"fake/loss": 15.0}
    assert worker.call("fake", "echo", 1, k=2) == ((1,), {"k": 2})
    with pytest.raises(KeyError):
        worker.call("fake", "hidden")
