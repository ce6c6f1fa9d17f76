"""The batch's columns (rows selected, chunked, joined, pickled), the verbs role classes declare,
how the driver's role proxy dispatches them, and how a worker runs them (a Batch chunk in, a
Batch column or metrics out), without Ray or a model."""

from __future__ import annotations

import pytest
import torch

from megarl.controller.group import RoleProxy
from megarl.controller.rl_worker import RLWorker
from megarl.protocol import Batch, Columns, Dispatch, Verb, declared_verbs, verb
from megarl.roles.actor import Actor
from megarl.roles.critic import Critic
from megarl.roles.reference import Reference
from megarl.roles.reward_model import RewardModel
from megarl.roles.rollout import Rollout


def batch_of(tokens: torch.Tensor, **columns) -> Batch:
    """A Batch of ``tokens`` [rows, seq], every row whole, zero scores."""
    rows, width = tokens.shape
    zeros = torch.zeros(rows, width)
    return Batch(tokens=tokens, labels=tokens, position_ids=tokens, loss_mask=zeros, rollout_log_probs=zeros,
                 lengths=torch.full((rows,), width), response_lengths=torch.ones(rows, dtype=torch.long),
                 scores=torch.zeros(rows), raw_scores=torch.zeros(rows), index=torch.arange(rows),
                 policy_versions=torch.zeros(rows, dtype=torch.long), prompt_ids=[[r] for r in range(rows)],
                 response_ids=[[r, r] for r in range(rows)], **columns)


def test_batch_rows_chunk_and_concat_keep_every_column():
    import pickle

    batch = batch_of(torch.arange(12).reshape(4, 3), policy_version=2, routing=torch.zeros(4, 3, 1, 2),
                     routing_metrics={"moe/x": 0.5})
    chunks = batch.chunk(2)
    assert [c.prompt_ids for c in chunks] == [[[0], [1]], [[2], [3]]] and chunks[1].routing.shape == (2, 3, 1, 2)
    joined = Batch.concat([pickle.loads(pickle.dumps(c)) for c in chunks])  # as they cross Ray
    assert torch.equal(joined.tokens, batch.tokens) and joined.response_ids == batch.response_ids
    assert joined.policy_version == 2 and joined.routing_metrics == {"moe/x": 0.5} and joined.old_log_probs is None
    picked = batch.rows(torch.tensor([3, 0]))
    assert picked.index.tolist() == [3, 0] and picked.prompt_ids == [[3], [0]]
    with pytest.raises(ValueError, match="do not split over 3 data-parallel ranks"):
        batch.chunk(3)
    with pytest.raises(ValueError, match="disagree on rows"):
        batch_of(torch.zeros(4, 3, dtype=torch.long), kl_penalty=torch.zeros(3))


def test_columns_set_batch_fields_and_refuse_others():
    batch = batch_of(torch.zeros(2, 3, dtype=torch.long))
    values = torch.ones(2, 3)
    merged = batch | Columns({"values": values}, {"moe/routing_mismatch_frac": 0.0})
    assert merged.values is values and merged.routing_metrics == {"moe/routing_mismatch_frac": 0.0}
    # the engine gets the per-token columns that are set; per-row fields stay behind
    tensors, lengths = merged.engine_inputs()
    assert list(tensors) == ["tokens", "labels", "position_ids", "loss_mask", "rollout_log_probs", "values"]
    with pytest.raises(ValueError, match=r"\['vals'\] are not Batch columns"):
        Columns({"vals": values})
    with pytest.raises(ValueError, match="verb output 'doubled' is not a Batch column"):
        verb(Dispatch.DP, output="doubled")


def test_role_classes_declare_their_verbs():
    dp = Dispatch.DP
    assert declared_verbs(Actor) == {"compute_log_prob": Verb(dp, output="old_log_probs"),
                                     "update": Verb(dp, optimizer_steps=True)}
    assert declared_verbs(Critic) == {"compute_values": Verb(dp, output="values"),
                                      "update": Verb(dp, optimizer_steps=True, metrics_prefix="critic/")}
    assert declared_verbs(Reference) == {"compute_log_prob": Verb(dp, output="ref_log_probs")}
    assert declared_verbs(RewardModel) == {"compute_scores": Verb(dp, output="scores")}
    assert declared_verbs(Rollout) == {name: Verb(Dispatch.ALL) for name in
                                       ("generate", "begin", "admit", "advance", "update_weights",
                                        "release_memory", "resume_memory")}


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
    batch = batch_of(torch.zeros(4, 8, dtype=torch.long))
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

    @verb(Dispatch.DP, output="values")
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
    chunk = batch_of(tokens, policy_version=4)
    chunk.lengths = torch.tensor([3, 2])
    out = worker.call("fake", "double", chunk)
    assert isinstance(out, Columns) and list(out.tensors) == ["values"] and torch.equal(out["values"], tokens * 2)
    # [rows, seq] tensors go to the engine; per-row fields (scores, the lengths) stay behind
    assert role.seen["keys"] == sorted(["tokens", "labels", "position_ids", "loss_mask", "rollout_log_probs"])
    assert torch.equal(role.seen["lengths"], torch.tensor([3, 2]))
    assert role.seen["how"] == "micro-batching"
    assert worker.call("fake", "score", chunk) == {"fake/loss": 15.0}
    assert worker.call("fake", "echo", 1, k=2) == ((1,), {"k": 2})
    with pytest.raises(KeyError):
        worker.call("fake", "hidden")
