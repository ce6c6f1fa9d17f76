"""Context-parallel token split (megarl.parallel.context): Megatron's load-balanced order.
(Against megatron-core's own split and the CP attention: tests/distributed/test_vocab_parallel.py.)"""

import pytest
import torch

from megarl.parallel.context import cp_chunk_starts, rank_positions, split_for_rank


def test_cp2_holds_chunks_r_and_3_minus_r():
    # 8 tokens, 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert rank_positions([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions([8], 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_chunk_starts(8, 2, 1) == (2, (2, 4))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_partition_every_segment(cp):
    segments = [4 * cp, 2 * cp, 6 * cp]
    positions = torch.cat([rank_positions(segments, cp, r) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(sum(segments)))
    for r in range(cp):  # a rank's tokens of each segment stay inside that segment, in order
        mine = rank_positions(segments, cp, r)
        assert len(mine) == sum(segments) // cp
        assert mine[: segments[0] // cp].max() < segments[0]


def test_split_selects_along_the_sequence_dim():
    x = torch.arange(2 * 8 * 3).view(2, 8, 3)
    assert torch.equal(split_for_rank(x, [8], 2, 1, dim=1), x[:, 2:6])


def test_length_not_divisible_by_2cp_is_refused():
    with pytest.raises(ValueError, match="2\\*cp = 4"):
        rank_positions([6], 2, 0)
