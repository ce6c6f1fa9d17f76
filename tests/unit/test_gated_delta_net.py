"""megarl's gated delta rule (megarl.models.gated_delta_net), the torch recurrence that stands in
for fla's kernel without CUDA: equal to transformers' Qwen3-Next reference (its chunked torch
implementation) to fp32 rounding, and a run continued from its state equals the run in one go
(what the native rollout's decode relies on). Its mapping tables: both directions exact."""

from __future__ import annotations

import pytest
import torch

from megarl.models.gated_delta_net import gated_delta_rule, l2_normalize
from megarl.models.hf_mapping import DeltaNetInProj, GatedQKV, ZeroCentred


def inputs(b=2, s=70, h=4, dk=8, dv=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, s, h, dk, generator=gen))
    k = l2_normalize(torch.randn(b, s, h, dk, generator=gen))
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, generator=gen) * 0.5  # log decay
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


def test_equals_transformers_chunked_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = inputs()  # 70 tokens: two of transformers' 64-token chunks, the second padded
    ours, state = gated_delta_rule(q, k, v, g, beta)
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=False)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert (state - ref_state).abs().max().item() <= 1e-5 * ref_state.abs().max().item()
    assert ref.abs().max().item() > 0.1  # not a run of zeros


def test_continued_from_its_state_equals_one_run():
    q, k, v, g, beta = inputs()
    whole, final = gated_delta_rule(q, k, v, g, beta)
    first, state = gated_delta_rule(q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50])
    rest = []
    for t in range(50, 70):  # one token at a time, as a decode step
        out, state = gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], state)
        rest.append(out)
    assert torch.equal(torch.cat([first] + rest, dim=1), whole) and torch.equal(state, final)


def test_zero_keys_and_values_leave_the_state_at_zero():
    """Left padding: a padded token's projections are zeroed, so the state a prompt starts from is 0."""
    q, k, v, g, beta = inputs(s=5)
    _, state = gated_delta_rule(q, torch.zeros_like(k), torch.zeros_like(v), g, beta)
    assert not state.any()


@pytest.mark.parametrize("transform,hf_shapes", [
    (DeltaNetInProj(2, 6, 8, 4, grouped=True), [(2 * (2 * 8 + 2 * 3 * 4), 5), (2 * 2 * 3, 5)]),
    (DeltaNetInProj(2, 6, 8, 4, grouped=False), [(2 * 2 * 8 + 6 * 4, 5), (6 * 4, 5), (6, 5), (6, 5)]),
    (GatedQKV(num_heads=6, num_groups=2, head_dim=4), [(2 * 6 * 4, 5), (2 * 4, 5), (2 * 4, 5)]),
    (ZeroCentred(), [(7,)]),
])
def test_tables_round_trip_exactly(transform, hf_shapes):
    gen = torch.Generator().manual_seed(1)
    hf = [torch.randn(shape, generator=gen) + (1.5 if isinstance(transform, ZeroCentred) else 0) for shape in hf_shapes]
    back = transform.to_hf(transform.to_mcore(hf))
    assert all(torch.equal(a, b) for a, b in zip(back, hf))


def test_grouped_in_proj_layout():
    """Qwen3-Next's in_proj_qkvz rows per key head [q; k; v; z] land in Megatron's [Q; K; V; Z]."""
    nk, nv, dk, dv = 2, 4, 3, 2
    r = nv // nk
    rows = []
    for head in range(nk):  # label each row by (part, key head, index)
        rows += [("q", head, i) for i in range(dk)] + [("k", head, i) for i in range(dk)]
        rows += [("v", head, i) for i in range(r * dv)] + [("z", head, i) for i in range(r * dv)]
    labels = {row: n for n, row in enumerate(rows)}
    qkvz = torch.tensor([float(labels[row]) for row in rows]).unsqueeze(1)
    ba = torch.arange(nk * 2 * r, dtype=torch.float32).unsqueeze(1) + 1000
    mcore = DeltaNetInProj(nk, nv, dk, dv).to_mcore([qkvz, ba])[:, 0].tolist()
    expected = [labels[(p, head, i)] for p, size in (("q", dk), ("k", dk), ("v", r * dv), ("z", r * dv))
                for head in range(nk) for i in range(size)]
    assert mcore[:len(expected)] == expected
    assert mcore[len(expected):] == [1000, 1001, 1004, 1005, 1002, 1003, 1006, 1007]  # [B; A] by key head
