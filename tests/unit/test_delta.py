"""megarl.hybrid.delta: every encoding round-trips bit for bit (into contiguous and strided
destinations), the smallest is chosen, bits count (not values), and the sender's copy follows."""

from __future__ import annotations

import pytest
import torch

from megarl.hybrid import delta as deltas
from megarl.hybrid.delta import Encoding


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def changed_copy(old: torch.Tensor, share: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    mask = torch.rand(old.numel(), generator=g) < share
    new[mask] = torch.randn(int(mask.sum()), generator=g).to(old.dtype)
    return new


def round_trip(new, old, force=None):
    message = deltas.encode(new, old, force=force)
    header, size = deltas.read_header(message.header, new.numel(), new.element_size())
    assert size == message.payload.numel()
    base = old.clone()
    half = new.numel() // 2
    rows = torch.empty(2, (new.numel() - half) // 2 + 3, dtype=old.dtype)  # a strided destination
    view = rows[:, :(new.numel() - half) // 2]
    view.copy_(base[half:half + view.numel()].view(view.shape))
    tail = base[half + view.numel():]
    deltas.apply(header, message.payload, new.dtype, [base[:half], view, tail])
    got = torch.cat([base[:half], view.reshape(-1), tail])
    assert torch.equal(bits(got), bits(new))
    return message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("share", [0.0, 1e-4, 0.01, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("numel", [9, 4096, 100_003])
def test_every_encoding_round_trips(dtype, share, numel):
    old = torch.randn(numel).to(dtype)
    new = changed_copy(old, share)
    chosen = round_trip(new, old)
    sizes = {k: deltas.payload_bytes(k, numel, chosen.nnz, new.element_size()) for k in Encoding}
    assert chosen.payload.numel() <= min(sizes.values()) + 8 + numel // 255  # escapes and alignment aside
    for force in (Encoding.gaps, Encoding.bitmask, Encoding.indices):
        round_trip(new, old, force)


def test_gaps_across_escape_boundaries():
    old = torch.zeros(3000, dtype=torch.bfloat16)
    new = old.clone()
    for at in (0, 255, 511, 766, 1021, 1022, 2043, 2999):  # gaps 254, 255, 254, 254, 0, 1020, 955
        new[at] = 1.0
    message = round_trip(new, old, Encoding.gaps)
    assert message.kind == Encoding.gaps and message.nnz == 8


def test_bits_not_values_decide():
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 16)
    new = old.clone()
    new[0] = -0.0  # equal as values, other bits
    message = round_trip(new, old)
    assert message.nnz == 1


def test_first_message_is_dense_and_the_copy_follows():
    sent = deltas.LastSent()
    old = torch.randn(1000).to(torch.bfloat16)
    assert sent.encode("k", old).kind == Encoding.dense
    new = changed_copy(old, 0.02)
    message = sent.encode("k", new)
    assert message.kind != Encoding.dense and torch.equal(bits(sent.copies["k"]), bits(new))
    assert sent.encode("k", new).nnz == 0
    sent.end_sync()
    sent.end_sync()  # a sync that did not use the key drops its copy
    assert not sent.copies and sent.nbytes == 0


def test_bf16_at_a_few_percent_sends_a_tenth():
    old = (0.02 * torch.randn(1 << 20)).to(torch.bfloat16)
    new = changed_copy(old, 0.05)
    message = deltas.encode(new, old)
    assert message.kind == Encoding.gaps
    assert message.payload.numel() < 0.08 * new.numel() * 2
