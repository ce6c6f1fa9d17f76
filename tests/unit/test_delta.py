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


@pytest.mark.parametrize("view", [lambda t: t[:, 2:5], lambda t: t[1:4, :, 3:6], lambda t: t[:, 3:4, :],
                                  lambda t: t[2:3], lambda t: t.transpose(0, 1)[3:5], lambda t: t[::2, :, 1:]])
def test_changed_elements_land_in_strided_views(view):
    """A delta written into a view of a 3-d tensor (ranges along several dims, size-1 and permuted
    dims) changes exactly the view's changed elements."""
    dest = torch.randn(6, 10, 7).to(torch.bfloat16)
    want = dest.clone()
    target = view(want)
    old = view(dest).reshape(-1).clone()
    new = changed_copy(old, 0.3)
    target.copy_(new.view(target.shape))
    message = deltas.encode(new, old, force=Encoding.gaps)
    header, _ = deltas.read_header(message.header, new.numel(), new.element_size())
    deltas.apply(header, message.payload, new.dtype, [view(dest)])
    assert torch.equal(bits(dest), bits(want))


@pytest.mark.skipif(not deltas.host.AVAILABLE, reason="numba is not installed (vLLM's CPU build brings it)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("share", [0.0, 0.0003, 0.002, 0.05, 0.3, 0.95])
@pytest.mark.parametrize("force", [None, Encoding.gaps, Encoding.bitmask, Encoding.indices])
def test_compiled_host_passes_write_the_numpy_passes_bytes(monkeypatch, dtype, share, force):
    """The numba single passes and the NumPy passes give the same header and payload, byte for byte,
    in every encoding (chosen or forced; the mask's last word partly filled, long gaps with escapes);
    and decode the same positions."""
    old = torch.randn(50_000).to(dtype)  # 781 mask words and 16 elements
    new = changed_copy(old, share)
    new[40_000] = old[40_000] + 1  # after a long unchanged run: escapes
    compiled = deltas.encode(new, old, force)
    monkeypatch.setattr(deltas.host, "AVAILABLE", False)
    plain = deltas.encode(new, old, force)
    assert compiled.kind == plain.kind and torch.equal(compiled.payload, plain.payload)
    if plain.kind != Encoding.dense:  # a dense header's count is a statistic (all, when not counted)
        assert torch.equal(compiled.header, plain.header)
    header, _ = deltas.read_header(plain.header, new.numel(), new.element_size())
    if header[0] != Encoding.dense:
        want = deltas.decode(header, plain.payload, dtype, new.numel())[0]
        monkeypatch.setattr(deltas.host, "AVAILABLE", True)
        assert torch.equal(deltas.decode(header, plain.payload, dtype, new.numel())[0], want)


def test_a_delta_leaves_the_destination_resizable():
    """The engines free their weights by resizing the storage to 0 (release_memory): writing a
    delta into them must not pin it (as Tensor.numpy() would)."""
    old = torch.randn(4096).to(torch.bfloat16)
    new = changed_copy(old, 0.05)
    dest = torch.zeros(2, 4096, dtype=torch.bfloat16)
    dest[0] = old
    message = deltas.encode(new, old)
    header, _ = deltas.read_header(message.header, new.numel(), new.element_size())
    deltas.apply(header, message.payload, new.dtype, [dest[0]])
    assert torch.equal(bits(dest[0]), bits(new))
    dest.untyped_storage().resize_(0)


def test_megarl_imports_numba_only_with_the_first_host_delta():
    """vLLM 0.32's workers fail to start in a process that has imported numba (its kernel
    dispatcher trips over llvmlite's objects): the engines start before the first sync, so the
    codec imports numba on the first host delta, never with megarl."""
    import subprocess
    import sys

    code = ("import sys, megarl.hybrid.delta, megarl.hybrid.transfer, megarl.hybrid.executor, "
            "megarl.rollout.vllm_engine, megarl.rollout.native; print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
