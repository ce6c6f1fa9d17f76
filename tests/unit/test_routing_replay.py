"""Routing replay pieces without a model: the router handle's choice, gradient and counts, the
sequence-parallel slicing of targets, the batch's routing tensor and its micro-batches."""

import torch

from megarl.data.datasets import PromptRecord
from megarl.engines import batching
from megarl.models.routing_replay import RouterHandle, clear, set_targets
from megarl.rollout import Response
from megarl.trainer.steps import Sampled, make_batch


def topk(scores, k, num_groups=None, group_topk=None):
    return torch.topk(scores, k=k, dim=1)


def test_replay_selects_the_target_and_keeps_the_router_gradient():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 2.0]], requires_grad=True)
    handle = RouterHandle(0)
    handle.replay = handle.count = True
    handle.target = torch.tensor([[2, 3], [3, 2], [-1, -1]])  # row 1: the live set, reordered; row 2: padding
    values, indices = handle.get_replay_topk(logits, 2, default_compute_topk=topk)
    assert indices.tolist() == [[2, 3], [3, 2], [0, 1]]  # padding takes experts 0..k-1
    assert torch.equal(values, logits.gather(1, indices))  # gating from the live logits
    values.sum().backward()
    assert logits.grad[0].tolist() == [0.0, 0.0, 1.0, 1.0]
    # used: all match the target; live: row 0 chose {0, 1}; the padding row is not counted
    assert (handle.mismatched, handle.live_mismatched, handle.compared) == (0, 1, 2)


def test_without_replay_the_live_choice_is_used_and_counted():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    handle = RouterHandle(0)
    handle.count = handle.record = True
    handle.target = torch.tensor([[2, 3], [2, 3]])
    _, indices = handle.get_replay_topk(logits, 2, default_compute_topk=topk)
    assert indices.tolist() == [[0, 1], [3, 2]] and torch.equal(handle.recorded, indices)
    assert (handle.mismatched, handle.live_mismatched, handle.compared) == (1, 1, 2)
    clear([handle])
    assert handle.target is None
    assert torch.equal(handle.get_replay_topk(logits, 2, default_compute_topk=topk)[1], indices)


def test_targets_follow_megatrons_sequence_first_order_and_sequence_parallel_slices():
    rows, seq, layers, k = 2, 4, 3, 2
    routing = torch.arange(rows * seq * layers * k).view(rows, seq, layers, k)
    handles = [RouterHandle(1)]
    set_targets(handles, routing, sp_rank=1, sp_size=2)
    # rank 1 of 2 holds positions 2..3 of every row, flattened [s, n]
    expected = torch.stack([routing[r, s, 1] for s in (2, 3) for r in range(rows)])
    assert torch.equal(handles[0].target, expected)


def _sampled():
    records = [PromptRecord("p0", "a", "t:0"), PromptRecord("p1", "b", "t:1")]
    prompts = [[5, 6, 7], [8, 9]]

    def response(p, tokens):
        fed = len(prompts[p]) + len(tokens) - 1
        return Response(p, 0, tokens, [-0.5] * len(tokens), "stop", 0,
                        routing=torch.arange(fed * 2 * 2, dtype=torch.int32).view(fed, 2, 2) + 100 * p)

    responses = [response(0, [1, 2]), response(1, [3, 4, 5])]
    return Sampled(records, prompts, responses, torch.zeros(2), torch.zeros(2))


def test_make_batch_aligns_routing_with_the_trainer_inputs():
    sampled = _sampled()
    batch = make_batch(sampled, pad_id=0, policy_version=0)
    routing, lengths = batch.routing, batch.lengths
    assert routing.shape == (*batch.tokens.shape, 2, 2)
    for i, r in enumerate(sampled.responses):
        assert torch.equal(routing[i, : lengths[i]], r.routing)
        assert (routing[i, lengths[i]:] == -1).all()


def test_packed_and_padded_micro_batches_carry_routing():
    batch = make_batch(_sampled(), pad_id=0, policy_version=0)
    tensors = {k: getattr(batch, k) for k in ("tokens", "position_ids", "routing")}
    lengths = batch.lengths
    rows = torch.tensor([0, 1])
    packed = batching.packed(tensors, rows, lengths, multiple=4)  # 4 + 4 tokens, no padding segment
    assert torch.equal(packed.tensors["routing"][0], torch.cat([tensors["routing"][r, : lengths[r]] for r in rows]))
    widened = batching.pad_to(batching.packed(tensors, rows[:1], lengths, multiple=1), 6)
    assert widened.tensors["routing"].shape == (1, 6, 2, 2) and (widened.tensors["routing"][0, 4:] == -1).all()
    padded = batching.pad_to(batching.padded(tensors, rows, lengths, multiple=1), 7)
    assert padded.tensors["routing"].shape == (2, 7, 2, 2) and (padded.tensors["routing"][:, 4:] == -1).all()
