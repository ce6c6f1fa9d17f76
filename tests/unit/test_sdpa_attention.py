"""SDPACoreAttention against a naive float64 reference (explicit softmax(QK^T * scale + mask) V).

Megatron layouts: query [sq, b, np, hn], key/value [sk, b, ng, hn], output [sq, b, np*hv];
packed ("thd"): query [t, np, hn], key/value [t, ng, hn], output [t, np*hv].
"""

from __future__ import annotations

import math

import pytest
import torch
import megarl  # noqa: F401 - before megatron: its lighter import on CPU (megarl/megatron_import.py)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.sdpa_attention import SDPACoreAttention

TOL = 1e-5
HN = 16


def make_config(num_heads=4, num_groups=2, **extra) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=num_heads,
                             num_query_groups=num_groups, kv_channels=HN,
                             use_cpu_initialization=True, **extra)


def make_attn(num_heads=4, num_groups=2, mask_type=AttnMaskType.causal, **kwargs) -> SDPACoreAttention:
    attn = SDPACoreAttention(make_config(num_heads, num_groups), layer_number=1,
                             attn_mask_type=mask_type, attention_type="self", **kwargs)
    return attn.eval()  # the default config has attention_dropout=0.1; eval turns it off


def rand_qkv(sq, sk, b, np_, ng, hn=HN, hv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hv = hn if hv is None else hv
    q = torch.randn(sq, b, np_, hn, generator=g)
    k = torch.randn(sk, b, ng, hn, generator=g)
    v = torch.randn(sk, b, ng, hv, generator=g)
    return q, k, v


def reference(q, k, v, *, causal=True, blocked=None, scale=None):
    """Naive attention in float64 on Megatron's sbhd layout.

    q [sq, b, np, hn], k [sk, b, ng, hn], v [sk, b, ng, hv]; blocked: bool [b, 1, sq, sk],
    True = blocked (Megatron convention). Query i sits at absolute position sk - sq + i.
    Returns [sq, b, np*hv] in float64.
    """
    sq, b, np_, hn = q.shape
    sk, _, ng, hv = v.shape
    scale = 1.0 / math.sqrt(hn) if scale is None else scale
    per_group = np_ // ng
    out = torch.zeros(sq, b, np_, hv, dtype=torch.float64)
    for bi in range(b):
        for h in range(np_):
            kvh = h // per_group
            qh = q[:, bi, h].double()          # [sq, hn]
            kh = k[:, bi, kvh].double()        # [sk, hn]
            vh = v[:, bi, kvh].double()        # [sk, hv]
            scores = qh @ kh.T * scale         # [sq, sk]
            allowed = torch.ones(sq, sk, dtype=torch.bool)
            if causal:
                for i in range(sq):
                    allowed[i, sk - sq + i + 1:] = False
            if blocked is not None:
                allowed &= ~blocked[bi, 0]
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[:, bi, h] = torch.softmax(scores, dim=-1) @ vh
    return out.reshape(sq, b, np_ * hv)


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Full sequences (sbhd)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("np_,ng", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("b", [1, 3])
def test_causal_full_sequence(np_, ng, b):
    attn = make_attn(np_, ng)
    q, k, v = rand_qkv(7, 7, b, np_, ng)
    out = attn(q, k, v, None)
    assert out.shape == (7, b, np_ * HN)
    assert out.dtype == torch.float32
    assert max_diff(out, reference(q, k, v)) <= TOL


def test_gqa_query_head_uses_kv_head_h_div_group():
    """Query heads 0,1 read kv head 0 and heads 2,3 kv head 1 (not 0,2 / 1,3 interleaved)."""
    attn = make_attn(4, 2)
    q, k, v = rand_qkv(5, 5, 1, 4, 2)
    # Make every query head identical: then output head h depends only on which kv head it uses.
    q = q[:, :, :1].expand(-1, -1, 4, -1).contiguous()
    out = attn(q, k, v, None).reshape(5, 1, 4, HN)
    assert max_diff(out[:, :, 0], out[:, :, 1]) <= TOL
    assert max_diff(out[:, :, 2], out[:, :, 3]) <= TOL
    assert max_diff(out[:, :, 0], out[:, :, 2]) > 1e-3


def test_no_mask_type_is_bidirectional():
    attn = make_attn(4, 2, mask_type=AttnMaskType.no_mask)
    q, k, v = rand_qkv(6, 6, 2, 4, 2)
    out = attn(q, k, v, None)
    assert max_diff(out, reference(q, k, v, causal=False)) <= TOL
    assert max_diff(out, reference(q, k, v, causal=True)) > 1e-3


def test_forward_attn_mask_type_overrides_constructor():
    attn = make_attn(4, 2, mask_type=AttnMaskType.causal)
    q, k, v = rand_qkv(6, 6, 2, 4, 2)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    assert max_diff(out, reference(q, k, v, causal=False)) <= TOL


# ---------------------------------------------------------------------------------------------
# KV-cache decode (sq < sk): causal mask aligned to the end of the key sequence
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("np_,ng", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("sq", [1, 3])
def test_kv_cache_decode_matches_reference_and_full_pass(np_, ng, sq):
    sk, b = 9, 2
    attn = make_attn(np_, ng)
    q_full, k, v = rand_qkv(sk, sk, b, np_, ng, seed=1)
    full = attn(q_full, k, v, None)                   # causal pass over all sk tokens
    assert max_diff(full, reference(q_full, k, v)) <= TOL

    q = q_full[sk - sq:]                              # the last sq queries, all sk keys
    out = attn(q, k, v, None)
    assert out.shape == (sq, b, np_ * HN)
    assert max_diff(out, reference(q, k, v)) <= TOL
    assert max_diff(out, full[sk - sq:]) <= TOL


@pytest.mark.parametrize("padded", [False, True])
def test_gqa_decode_step_reads_kv_in_place(padded):
    """The native engine's decode step (one query, a padding mask, no causal type): the fast path
    that attends with the group's query heads as queries equals the copied-K/V reference."""
    sk, b, np_, ng = 7, 3, 8, 2
    attn = make_attn(np_, ng, mask_type=AttnMaskType.padding)
    q, k, v = rand_qkv(1, sk, b, np_, ng, seed=4)
    blocked = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
    if padded:
        blocked[0, ..., :2] = True  # row 0 was left-padded by two tokens
        blocked[2, ..., :4] = True
    out = attn(q, k, v, blocked)
    assert max_diff(out, reference(q, k, v, causal=False, blocked=blocked)) <= TOL


def test_decode_first_query_cannot_see_later_keys():
    """Query 0 of a 3-token chunk after 5 cached tokens sits at position 5: keys 6, 7 are hidden."""
    sq, sk = 3, 8
    attn = make_attn(4, 2)
    q, k, v = rand_qkv(sq, sk, 1, 4, 2, seed=2)
    out = attn(q, k, v, None)
    k2, v2 = k.clone(), v.clone()
    k2[6:] += 5.0
    v2[6:] += 5.0
    out2 = attn(q, k2, v2, None)
    assert max_diff(out[0], out2[0]) <= TOL           # position 5 sees keys 0..5 only
    assert max_diff(out[1], out2[1]) > 1e-3           # position 6 sees key 6


# ---------------------------------------------------------------------------------------------
# Explicit boolean masks (True = blocked), combined with causal
# ---------------------------------------------------------------------------------------------

def random_blocked(b, sq, sk, seed=3):
    g = torch.Generator().manual_seed(seed)
    blocked = torch.rand(b, 1, sq, sk, generator=g) < 0.4
    # keep each query's own position allowed so no row is fully blocked
    for i in range(sq):
        blocked[:, 0, i, sk - sq + i] = False
    return blocked


@pytest.mark.parametrize("sq,sk", [(6, 6), (3, 7)], ids=["full", "decode"])
def test_explicit_mask_combined_with_causal(sq, sk):
    b = 2
    attn = make_attn(4, 2)
    q, k, v = rand_qkv(sq, sk, b, 4, 2, seed=4)
    blocked = random_blocked(b, sq, sk)
    out = attn(q, k, v, blocked)
    assert max_diff(out, reference(q, k, v, causal=True, blocked=blocked)) <= TOL
    # the mask really matters
    assert max_diff(out, reference(q, k, v, causal=True)) > 1e-3


def test_explicit_mask_padding_type_is_not_causal():
    sq = sk = 5
    attn = make_attn(4, 2, mask_type=AttnMaskType.padding)
    q, k, v = rand_qkv(sq, sk, 2, 4, 2, seed=5)
    blocked = torch.zeros(2, 1, sq, sk, dtype=torch.bool)
    blocked[1, :, :, 3:] = True                       # sample 1: last two keys are padding
    out = attn(q, k, v, blocked)
    assert max_diff(out, reference(q, k, v, causal=False, blocked=blocked)) <= TOL


def test_all_false_mask_equals_no_mask():
    attn = make_attn(4, 2)
    q, k, v = rand_qkv(6, 6, 2, 4, 2, seed=6)
    out = attn(q, k, v, torch.zeros(2, 1, 6, 6, dtype=torch.bool))
    assert max_diff(out, attn(q, k, v, None)) <= TOL


# ---------------------------------------------------------------------------------------------
# softmax_scale, MLA-like value head dim
# ---------------------------------------------------------------------------------------------

def test_custom_softmax_scale():
    scale = 0.37
    attn = make_attn(4, 2, softmax_scale=scale)
    q, k, v = rand_qkv(6, 6, 2, 4, 2, seed=7)
    out = attn(q, k, v, None)
    assert max_diff(out, reference(q, k, v, scale=scale)) <= TOL
    assert max_diff(out, reference(q, k, v)) > 1e-3  # default 1/sqrt(16) = 0.25 differs
    # also on the explicit-mask and decode paths
    assert max_diff(attn(q[4:], k, v, None), reference(q[4:], k, v, scale=scale)) <= TOL
    blocked = random_blocked(2, 6, 6)
    assert max_diff(attn(q, k, v, blocked), reference(q, k, v, blocked=blocked, scale=scale)) <= TOL


@pytest.mark.parametrize("sq,sk", [(6, 6), (2, 6)], ids=["full", "decode"])
def test_mla_value_head_dim_differs(sq, sk):
    hv = 8
    attn = make_attn(4, 4, k_channels=HN, v_channels=hv)
    q, k, v = rand_qkv(sq, sk, 2, 4, 4, hn=HN, hv=hv, seed=8)
    out = attn(q, k, v, None)
    assert out.shape == (sq, 2, 4 * hv)
    assert max_diff(out, reference(q, k, v)) <= TOL


# ---------------------------------------------------------------------------------------------
# Packed sequences (thd)
# ---------------------------------------------------------------------------------------------

def packed_params(lengths, padded_lengths=None):
    def cu(ls):
        return torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int32)
    kwargs = dict(qkv_format="thd", cu_seqlens_q=cu(lengths), cu_seqlens_kv=cu(lengths),
                  max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    if padded_lengths is not None:
        kwargs.update(cu_seqlens_q_padded=cu(padded_lengths), cu_seqlens_kv_padded=cu(padded_lengths))
    return PackedSeqParams(**kwargs)


@pytest.mark.parametrize("np_,ng,hv", [(4, 2, HN), (4, 4, HN), (4, 4, 8)], ids=["gqa", "mha", "mla"])
def test_packed_equals_separate_sequences(np_, ng, hv):
    lengths = [3, 5, 1]
    t = sum(lengths)
    attn = make_attn(np_, ng)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(t, np_, HN, generator=g)
    k = torch.randn(t, ng, HN, generator=g)
    v = torch.randn(t, ng, hv, generator=g)
    out = attn(q, k, v, None, packed_seq_params=packed_params(lengths))
    assert out.shape == (t, np_ * hv)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        # each sequence on its own, as a batch of one in sbhd layout
        sep = attn(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1), None)[:, 0]
        ref = reference(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1))[:, 0]
        assert max_diff(out[sl], sep) <= TOL
        assert max_diff(out[sl], ref) <= TOL
        start += n


def test_packed_sequences_do_not_attend_across_boundaries():
    lengths = [3, 5, 1]
    attn = make_attn(4, 2)
    g = torch.Generator().manual_seed(10)
    q, k, v = torch.randn(9, 4, HN, generator=g), torch.randn(9, 2, HN, generator=g), torch.randn(9, 2, HN, generator=g)
    params = packed_params(lengths)
    out = attn(q, k, v, None, packed_seq_params=params)
    k2, v2 = k.clone(), v.clone()
    k2[:3] += 3.0                                     # perturb sequence 0 only
    v2[:3] += 3.0
    out2 = attn(q, k2, v2, None, packed_seq_params=params)
    assert max_diff(out[3:], out2[3:]) <= TOL
    assert max_diff(out[:3], out2[:3]) > 1e-3


def test_packed_with_padded_cu_seqlens_causal_real_tokens():
    """With padded bounds (sequences padded to a multiple of 4), the real tokens of each
    sequence are unaffected by the padding tokens that follow them under a causal mask."""
    lengths, padded = [3, 5, 1], [4, 8, 4]
    t = sum(padded)
    attn = make_attn(4, 2)
    g = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(t, 4, HN, generator=g), torch.randn(t, 2, HN, generator=g), torch.randn(t, 2, HN, generator=g)
    out = attn(q, k, v, None, packed_seq_params=packed_params(lengths, padded))
    start = 0
    for n, p in zip(lengths, padded):
        sl = slice(start, start + n)
        ref = reference(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1))[:, 0]
        assert max_diff(out[sl], ref) <= TOL
        start += p


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_attention_bias_raises():
    attn = make_attn(4, 2)
    q, k, v = rand_qkv(4, 4, 1, 4, 2)
    with pytest.raises(ValueError, match="attention_bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1, 4, 4, 4))


def test_eval_mode_is_deterministic_and_dropout_off():
    attn = make_attn(4, 2)
    assert attn.dropout_p == pytest.approx(0.1)       # taken from the config
    q, k, v = rand_qkv(6, 6, 1, 4, 2)
    assert max_diff(attn(q, k, v, None), attn(q, k, v, None)) == 0.0
    no_drop = SDPACoreAttention(make_config(), 1, AttnMaskType.causal, "self", attention_dropout=0.0)
    assert no_drop.dropout_p == 0.0
    assert max_diff(no_drop.train()(q, k, v, None), reference(q, k, v)) <= TOL


# ---------------------------------------------------------------------------------------------
# Fully masked rows, gradients
# ---------------------------------------------------------------------------------------------

def test_fully_masked_query_rows_stay_finite():
    """Left-padding queries whose keys are all blocked must not turn into NaN (a NaN value row
    would poison every later layer through probs @ V even at zero weight)."""
    sq = sk = 6
    attn = make_attn(4, 2)
    q, k, v = rand_qkv(sq, sk, 2, 4, 2, seed=12)
    blocked = torch.zeros(2, 1, sq, sk, dtype=torch.bool)
    blocked[1, :, :, :2] = True                       # sample 1: two left-padding tokens
    out = attn(q, k, v, blocked)
    assert torch.isfinite(out).all()
    ref = reference(q, k, v, causal=True, blocked=blocked)  # rows 0, 1 of sample 1 are NaN here
    assert max_diff(out[:, 0], ref[:, 0]) <= TOL
    assert max_diff(out[2:, 1], ref[2:, 1]) <= TOL


def reference_packed(q, k, v, lengths):
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(reference(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1))[:, 0])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_gradients_match_reference(packed):
    attn = make_attn(4, 2)
    g = torch.Generator().manual_seed(13)
    lengths = [3, 5, 1]
    if packed:
        shapes = [(9, 4, HN), (9, 2, HN), (9, 2, HN)]
    else:
        shapes = [(5, 2, 4, HN), (7, 2, 2, HN), (7, 2, 2, HN)]   # decode-style sq < sk
    tensors = [torch.randn(*s, generator=g) for s in shapes]
    grad_out = torch.randn(9, 4 * HN, generator=g) if packed else torch.randn(5, 2, 4 * HN, generator=g)

    leaves = [t.clone().requires_grad_(True) for t in tensors]
    if packed:
        out = attn(*leaves, None, packed_seq_params=packed_params(lengths))
    else:
        out = attn(*leaves, None)
    out.backward(grad_out)

    ref_leaves = [t.double().requires_grad_(True) for t in tensors]
    ref = reference_packed(*ref_leaves, lengths) if packed else reference(*ref_leaves)
    ref.backward(grad_out.double())
    for got, want in zip(leaves, ref_leaves):
        assert max_diff(got.grad, want.grad) <= 1e-4
