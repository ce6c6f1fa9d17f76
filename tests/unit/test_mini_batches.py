"""PPO mini-batches and epochs (MiniBatches.plan): the same global mini-batches at every dp,
each row once per epoch, a new shuffle each epoch, equal shares per DP rank."""

import pytest
import torch

from megarl.engines.megatron_engine import MiniBatches


def global_steps(mini: MiniBatches, rows: int, dp: int):
    plans = [mini.plan(rows, dp, rank) for rank in range(dp)]
    return [sorted(torch.cat([plan[k] for plan in plans]).tolist()) for k in range(len(plans[0]))]


def test_every_dp_trains_the_same_mini_batches():
    mini = MiniBatches(size=8, epochs=3, seed=11)
    single = global_steps(mini, 32, 1)
    assert len(single) == 4 * 3
    for dp in (2, 4, 8):
        assert global_steps(mini, 32, dp) == single
        assert all(len(rows) == 8 // dp for rows in mini.plan(32, dp, dp - 1))


def test_each_epoch_covers_every_row_once_in_a_new_order():
    steps = global_steps(MiniBatches(size=4, epochs=2, seed=3), 16, 2)
    first, second = steps[:4], steps[4:]
    assert sorted(sum(first, [])) == list(range(16)) == sorted(sum(second, []))
    assert first != second
    assert first != [list(range(i, i + 4)) for i in range(0, 16, 4)]  # shuffled, not in order


def test_the_seed_picks_the_shuffle():
    assert global_steps(MiniBatches(4, 1, seed=1), 16, 1) != global_steps(MiniBatches(4, 1, seed=2), 16, 1)
    assert global_steps(MiniBatches(4, 1, seed=1), 16, 1) == global_steps(MiniBatches(4, 1, seed=1), 16, 1)


def test_one_mini_batch_keeps_each_rank_its_own_rows():
    # size 0 (the default) = the whole batch: today's single step on the driver's DP chunk
    assert [r.tolist() for r in MiniBatches(0, 2).plan(8, 2, 1)] == [[4, 5, 6, 7], [4, 5, 6, 7]]


@pytest.mark.parametrize("size,dp", [(3, 1), (32, 1), (4, 8)])
def test_a_size_that_does_not_split_is_refused(size, dp):
    with pytest.raises(ValueError, match=f"mini-batch of {size} sequences"):
        MiniBatches(size, 1).plan(16, dp, 0)


def test_zero_epochs_is_refused():
    with pytest.raises(ValueError, match="epochs 0"):
        MiniBatches(4, 0)
