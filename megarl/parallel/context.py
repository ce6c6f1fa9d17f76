"""Context parallelism: which tokens of a sequence each CP rank holds, and gathering them back.

Megatron's load-balanced order (``megatron.core.utils.get_batch_on_this_cp_rank``): a sequence
of length L (a multiple of 2·cp) is cut into 2·cp chunks of L/(2·cp) tokens; CP rank r holds
chunks r and 2·cp-1-r, in that order, so every rank gets the same causal-attention work.
Packed (THD) rows apply the same cut to each sequence (segment) separately.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.distributed as dist


def cp_chunk_starts(length: int, cp: int, rank: int) -> Tuple[int, Tuple[int, int]]:
    """(chunk size, start positions of the two chunks CP ``rank`` holds) of a ``length``-token
    sequence."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2*cp = {2 * cp} chunks; "
                         f"pad it to a multiple of {2 * cp}")
    chunk = length // (2 * cp)
    return chunk, (rank * chunk, (2 * cp - 1 - rank) * chunk)


def rank_positions(segment_lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Positions, in the concatenation of the segments, of the tokens CP ``rank`` holds, in its
    local order (segment by segment, two chunks each). One segment = a padded row."""
    parts, offset = [], 0
    for length in segment_lengths:
        chunk, starts = cp_chunk_starts(length, cp, rank)
        parts += [torch.arange(offset + s, offset + s + chunk) for s in starts]
        offset += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_for_rank(t: torch.Tensor, segment_lengths: Sequence[int], cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``t`` (sequence along ``dim``)."""
    return t.index_select(dim, rank_positions(segment_lengths, cp, rank).to(t.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the ranks' shares end to end); the backward sums the gradient
    over the group and returns this rank's share. torch.distributed.nn's all-gather is not used:
    its gloo backward passes group ranks where ``dist.scatter`` wants global ranks, which fails
    in any group but the world."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        share = grad.shape[0] // dist.get_world_size(group)
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = grad.new_empty(share, *grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
            return out, None
        grad = grad.contiguous()  # gloo has no reduce-scatter: sum everything, keep this rank's share
        dist.all_reduce(grad, group=group)
        rank = dist.get_rank(group)
        return grad[rank * share:(rank + 1) * share], None


def gather_sequence(local: torch.Tensor, group, segment_lengths: Sequence[int], dim: int) -> torch.Tensor:
    """Every CP rank's tokens of ``local`` (this rank's share along ``dim``) back in sequence
    order. Differentiable: the backward returns each rank the gradient of its own tokens summed
    over the ranks."""
    cp = dist.get_world_size(group)
    gathered = _GatherSequence.apply(local.movedim(dim, 0).contiguous(), group).movedim(0, dim)
    order = torch.cat([rank_positions(segment_lengths, cp, r) for r in range(cp)])
    inverse = torch.argsort(order).to(local.device)  # gathered column of each sequence position
    return gathered.index_select(dim, inverse)
