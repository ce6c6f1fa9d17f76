"""Sliding windows and attention sinks in SDPACoreAttention against a naive float64 reference
whose masks are built entry by entry from the definitions:

- window_size=(left, right) (Megatron's TransformerConfig; -1 = unbounded): query at position p
  attends key j iff p - left <= j <= p + right, and j <= p if causal; HF sliding_window W is
  (W-1, 0). Which layers slide: Megatron's window_attn_skip_freq (an int N: every N-th layer,
  1-based, is full; a list: 1 = sliding).
- softmax_type='learnable': out = softmax([scores, sink_h])[:-1] @ V with the per-head logit
  ``softmax_offset``; 'off-by-one': sink_h = 0.

Layouts as Megatron's: query [sq, b, np, hn], key/value [sk, b, ng, hn]; packed [t, heads, hn].
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import megarl  # noqa: F401 - before megatron: its lighter import on CPU (megarl/megatron_import.py)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.sdpa_attention import SDPACoreAttention
from tests.unit.test_sdpa_attention import HN, TOL, max_diff, packed_params, rand_qkv

GRAD_TOL = 1e-5


def make_attn(np_=4, ng=2, mask_type=AttnMaskType.causal, layer_number=1, num_layers=1, sinks=None,
              pg_collection=None, **config) -> SDPACoreAttention:
    """An attention in eval mode (no dropout); ``sinks``: values for the learnable sink logits."""
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=np_, num_query_groups=ng,
                            kv_channels=HN, attention_dropout=0.0, use_cpu_initialization=True, **config)
    attn = SDPACoreAttention(cfg, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self",
                             pg_collection=pg_collection).eval()
    if sinks is not None:
        with torch.no_grad():
            attn.softmax_offset.copy_(sinks)
    return attn


def allowed_entries(sq, sk, *, q_start=None, causal=True, window=None):
    """[sq, sk] bool from the definitions, one entry at a time."""
    q_start = sk - sq if q_start is None else q_start
    allowed = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        p = q_start + i
        for j in range(sk):
            ok = not (causal and j > p)
            if window is not None:
                left, right = window
                ok = ok and (left == -1 or j >= p - left) and (right == -1 or j <= p + right)
            allowed[i, j] = ok
    return allowed


def reference(q, k, v, *, causal=True, window=None, blocked=None, sinks=None, scale=None):
    """Naive attention in float64 (differentiable in q, k, v and ``sinks``). Query i sits at
    position sk - sq + i; blocked: bool [b, 1, sq, sk], True = blocked (Megatron's convention);
    sinks [np]: one more softmax column per head, dropped after the softmax. [sq, b, np*hv]."""
    sq, b, np_, hn = q.shape
    sk, _, ng, hv = v.shape
    scale = 1.0 / math.sqrt(hn) if scale is None else scale
    base = allowed_entries(sq, sk, causal=causal, window=window)
    heads = []
    for bi in range(b):
        allowed = base if blocked is None else base & ~blocked[bi, 0]
        row = []
        for h in range(np_):
            kvh = h // (np_ // ng)
            scores = q[:, bi, h].double() @ k[:, bi, kvh].double().T * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                column = sinks[h].double().expand(sq, 1)
                probs = torch.softmax(torch.cat([scores, column], dim=1), dim=1)[:, :-1]
            else:
                probs = torch.softmax(scores, dim=1)
            row.append(probs @ v[:, bi, kvh].double())
        heads.append(torch.stack(row, dim=1))  # [sq, np, hv]
    return torch.stack(heads, dim=1).reshape(sq, b, np_ * hv)


def random_sinks(np_, seed=20):
    return torch.randn(np_, generator=torch.Generator().manual_seed(seed)) * 2


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("w", [1, 2, 4, 7, 12], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("np_,ng", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_causal_window_matches_reference(w, np_, ng):
    attn = make_attn(np_, ng, window_size=(w - 1, 0))
    q, k, v = rand_qkv(7, 7, 2, np_, ng, seed=w)
    out = attn(q, k, v, None)
    assert max_diff(out, reference(q, k, v, window=(w - 1, 0))) <= TOL
    full = reference(q, k, v)
    if w >= 7:  # a window as long as the sequence is no window
        assert max_diff(out, full) <= TOL
    else:
        assert max_diff(out, full) > 1e-3


@pytest.mark.parametrize("window", [(2, 1), (0, 0), (-1, 2), (3, -1)], ids=str)
def test_bidirectional_window_and_unbounded_sides(window):
    attn = make_attn(mask_type=AttnMaskType.no_mask, window_size=window)
    q, k, v = rand_qkv(6, 6, 2, 4, 2, seed=21)
    assert max_diff(attn(q, k, v, None), reference(q, k, v, causal=False, window=window)) <= TOL


def test_causal_layer_ignores_a_right_window():
    """A causal layer never sees later keys, whatever the window's right side (as TE, which
    sets it to 0 for causal masks)."""
    q, k, v = rand_qkv(6, 6, 1, 4, 2, seed=22)
    assert max_diff(make_attn(window_size=(2, 3))(q, k, v, None), reference(q, k, v, window=(2, 0))) <= TOL


@pytest.mark.parametrize("skip,sliding", [(None, [1, 1, 1, 1]), (2, [1, 0, 1, 0]), (3, [1, 1, 0, 1]),
                                          ([0, 1, 1, 0], [0, 1, 1, 0])], ids=["none", "2", "3", "list"])
def test_window_attn_skip_freq_picks_the_sliding_layers(skip, sliding):
    """Megatron's rule: layer n (1-based) is full when n % N == 0, or when the list says 0."""
    from megatron.core.transformer.utils import is_layer_window_attention

    q, k, v = rand_qkv(6, 6, 1, 4, 2, seed=23)
    windowed, full = reference(q, k, v, window=(1, 0)), reference(q, k, v)
    for n, slides in enumerate(sliding, start=1):
        assert is_layer_window_attention((1, 0), skip, n) == bool(slides)
        out = make_attn(layer_number=n, num_layers=4, window_size=(1, 0), window_attn_skip_freq=skip)(q, k, v, None)
        assert max_diff(out, windowed if slides else full) <= TOL, n


def test_bad_window_settings_are_refused():
    with pytest.raises(ValueError, match="window_size=\\(4, -2\\)"):
        make_attn(window_size=(4, -2))
    with pytest.raises(ValueError, match="window_attn_skip_freq lists 2 layers but layer 3"):
        make_attn(layer_number=3, num_layers=3, window_size=(4, 0), window_attn_skip_freq=[1, 0])


@pytest.mark.parametrize("sq,sk", [(6, 6), (3, 8)], ids=["full", "decode"])
def test_window_with_padding_mask(sq, sk):
    attn = make_attn(window_size=(2, 0))
    q, k, v = rand_qkv(sq, sk, 2, 4, 2, seed=24)
    blocked = torch.zeros(2, 1, sq, sk, dtype=torch.bool)
    blocked[1, :, :, :2] = True  # sample 1 is left-padded by two tokens
    blocked[1, :, torch.arange(sq), torch.arange(sk - sq, sk)] = False  # every query sees itself
    out = attn(q, k, v, blocked)
    assert max_diff(out, reference(q, k, v, window=(2, 0), blocked=blocked)) <= TOL


# ---------------------------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------------------------

def test_sink_parameter_megatron_name_shape_and_tp_attributes():
    attn = make_attn(8, 2, softmax_type="learnable")
    assert [name for name, _ in attn.named_parameters()] == ["softmax_offset"]
    assert attn.softmax_offset.shape == (8,)
    assert (attn.softmax_offset.tensor_model_parallel, attn.softmax_offset.partition_dim) == (True, 0)
    assert attn.softmax_offset.abs().max() > 0  # drawn with the config's init method
    assert list(make_attn(8, 2, softmax_type="off-by-one").parameters()) == []


def test_sinks_build_on_the_meta_device():
    """check_pretrained's pre-flight builds the model under torch.device("meta") (shapes only)."""
    with torch.device("meta"):
        attn = make_attn(8, 2, softmax_type="learnable")
    assert attn.softmax_offset.is_meta and attn.softmax_offset.shape == (8,)
    assert attn.softmax_offset.tensor_model_parallel


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_sinks_are_split_over_tp_like_the_heads(monkeypatch):
    """TP rank r holds the sink logits of heads r*np/tp..: those of the tp = 1 model drawn from
    the same seed, so every TP layout starts from the same model; its checkpoint entry is a
    TP shard of the [heads] tensor (megatron-core reads group sizes only under torch.distributed)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    torch.manual_seed(5)
    whole = make_attn(8, 4, softmax_type="learnable").softmax_offset
    for rank in range(2):
        torch.manual_seed(5)
        shard = make_attn(8, 4, softmax_type="learnable", pg_collection=SimpleNamespace(tp=_Group(2, rank)))
        assert torch.equal(shard.softmax_offset, whole[rank * 4:(rank + 1) * 4])
        entry = shard.sharded_state_dict("core_attention.", metadata={"dp_cp_group": _Group(1, 0)})
        tensor = entry["core_attention.softmax_offset"]
        assert (tensor.global_shape, tensor.global_offset) == ((8,), (rank * 4,))


@pytest.mark.parametrize("np_,ng", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("window", [None, (2, 0)], ids=["full", "window"])
@pytest.mark.parametrize("sq", [7, 3], ids=["full", "decode"])
def test_sinks_forward_and_gradients(np_, ng, window, sq):
    sinks = random_sinks(np_)
    attn = make_attn(np_, ng, softmax_type="learnable", sinks=sinks,
                     **({} if window is None else {"window_size": window}))
    tensors = rand_qkv(sq, 7, 2, np_, ng, seed=25)
    grad_out = torch.randn(sq, 2, np_ * HN, generator=torch.Generator().manual_seed(26))
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = attn(*leaves, None)
    out.backward(grad_out)

    ref_leaves = [t.double().requires_grad_() for t in (*tensors, sinks)]
    ref = reference(*ref_leaves[:3], window=window, sinks=ref_leaves[3])
    ref.backward(grad_out.double())
    assert max_diff(out, ref) <= TOL
    assert max_diff(out, reference(*tensors, window=window)) > 1e-3  # the sinks matter
    for got, want in zip([*leaves, attn.softmax_offset], ref_leaves):
        assert max_diff(got.grad, want.grad) <= GRAD_TOL


def test_sink_gradient_matches_finite_differences():
    attn = make_attn(softmax_type="learnable", sinks=random_sinks(4), window_size=(3, 0))
    attn.double()
    q, k, v = (t.double() for t in rand_qkv(6, 6, 2, 4, 2, seed=27))
    weights = torch.randn(6, 2, 4 * HN, generator=torch.Generator().manual_seed(28), dtype=torch.float64)
    (attn(q, k, v, None) * weights).sum().backward()
    eps = 1e-6
    for h in range(4):
        with torch.no_grad():
            attn.softmax_offset[h] += eps
            up = (attn(q, k, v, None) * weights).sum()
            attn.softmax_offset[h] -= 2 * eps
            down = (attn(q, k, v, None) * weights).sum()
            attn.softmax_offset[h] += eps
        assert abs((up - down).item() / (2 * eps) - attn.softmax_offset.grad[h].item()) <= 1e-7


def test_off_by_one_is_a_zero_sink():
    attn = make_attn(softmax_type="off-by-one", window_size=(3, 0))
    q, k, v = rand_qkv(6, 6, 2, 4, 2, seed=29)
    assert max_diff(attn(q, k, v, None), reference(q, k, v, window=(3, 0), sinks=torch.zeros(4))) <= TOL


def test_sinks_with_padding_mask_and_fully_masked_rows():
    """A query whose keys are all blocked puts all its weight on the sink: zeros, not NaN."""
    attn = make_attn(softmax_type="learnable", sinks=random_sinks(4), window_size=(2, 0))
    q, k, v = rand_qkv(6, 6, 2, 4, 2, seed=30)
    blocked = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    blocked[1, :, :, :2] = True  # sample 1: two left-padding tokens, its first two queries see nothing
    out = attn(q, k, v, blocked)
    assert max_diff(out, reference(q, k, v, window=(2, 0), blocked=blocked, sinks=random_sinks(4))) <= TOL
    assert out[:2, 1].abs().max() == 0


def test_sinks_dropout_only_in_training():
    attn = make_attn(softmax_type="learnable", sinks=random_sinks(4))
    attn.dropout_p = 0.5
    q, k, v = rand_qkv(6, 6, 1, 4, 2, seed=31)
    torch.manual_seed(0)
    out = attn.train()(q, k, v, None)
    assert max_diff(out, attn.eval()(q, k, v, None)) > 1e-3
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("sq", [6, 2], ids=["full", "decode"])
def test_sinks_with_mla_value_head_dim(sq):
    sinks = random_sinks(4)
    attn = make_attn(4, 4, softmax_type="learnable", sinks=sinks, window_size=(2, 0))
    q, k, v = rand_qkv(sq, 6, 2, 4, 4, hv=8, seed=34)
    out = attn(q, k, v, None)
    assert out.shape == (sq, 2, 4 * 8)
    assert max_diff(out, reference(q, k, v, window=(2, 0), sinks=sinks)) <= TOL


# ---------------------------------------------------------------------------------------------
# Packed sequences (thd): windows per sequence, positions relative to each sequence's start
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padded", [None, [4, 8, 4]], ids=["exact", "padded_bounds"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_packed_window_and_sinks_per_sequence(padded, softmax_type):
    lengths = [3, 5, 1]
    spans = padded or lengths
    t = sum(spans)
    sinks = random_sinks(4) if softmax_type == "learnable" else None
    attn = make_attn(softmax_type=softmax_type, sinks=sinks, window_size=(1, 0))
    g = torch.Generator().manual_seed(32)
    q, k, v = torch.randn(t, 4, HN, generator=g), torch.randn(t, 2, HN, generator=g), torch.randn(t, 2, HN, generator=g)
    out = attn(q, k, v, None, packed_seq_params=packed_params(lengths, padded))
    start = 0
    for n, span in zip(lengths, spans):
        sl = slice(start, start + n)
        ref = reference(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1), window=(1, 0), sinks=sinks)
        assert max_diff(out[sl], ref[:, 0]) <= TOL
        start += span


# ---------------------------------------------------------------------------------------------
# KV-cache decode as the native engine runs it: a causal prefill with the padding mask, then
# one-token steps (mask type no_mask, the padding mask over every cached key)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("np_,ng", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("w", [1, 3, 20], ids=lambda w: f"W{w}")
def test_decode_token_by_token_equals_full_forward(softmax_type, np_, ng, w):
    b, prompt, total = 3, 4, 10
    sinks = random_sinks(np_) if softmax_type == "learnable" else None
    attn = make_attn(np_, ng, softmax_type=softmax_type, sinks=sinks, window_size=(w - 1, 0))
    q, k, v = rand_qkv(total, total, b, np_, ng, seed=33)
    valid = torch.ones(b, total, dtype=torch.bool)
    valid[1, :2] = False  # row 1 was left-padded by two tokens
    eye = torch.eye(total, dtype=torch.bool)
    blocked = ~(valid[:, None, None, :] | eye)  # a pad query sees itself (its output is unused)
    full = attn(q, k, v, blocked)
    ref = reference(q, k, v, window=(w - 1, 0), blocked=blocked, sinks=sinks)
    assert max_diff(full, ref) <= TOL

    steps = [attn(q[:prompt], k[:prompt], v[:prompt], blocked[:, :, :prompt, :prompt])]
    for pos in range(prompt, total):
        steps.append(attn(q[pos:pos + 1], k[:pos + 1], v[:pos + 1], ~valid[:, None, None, :pos + 1],
                          attn_mask_type=AttnMaskType.no_mask))
    decoded = torch.cat(steps)
    assert max_diff(decoded[:, 0], full[:, 0]) <= TOL
    assert max_diff(decoded[2:, 1], full[2:, 1]) <= TOL  # row 1's real tokens


# ---------------------------------------------------------------------------------------------
# megarl's builder: the TransformerConfig fields reach the local spec's core attention
# ---------------------------------------------------------------------------------------------

def test_builder_passes_window_and_sinks_to_the_core_attention():
    """tiny-llama (4 layers) with a window on every other layer and learnable sinks, as
    hf_config would pass them; Megatron's attention builds the core attention with the global
    1-based layer number, which the windows follow."""
    from megarl.config import ModelConfig
    from megarl.models.builder import layer_spec, transformer_config
    from megarl.models.hf_config import megatron_args_from_hf
    from megarl.parallel.layout import Layout
    from tests.unit.test_te_key_names import ROOT

    hf = str(ROOT / "configs" / "models" / "tiny-llama.json")
    args = megatron_args_from_hf(hf)
    args.config_kwargs.update(window_size=(2, 0), window_attn_skip_freq=2, softmax_type="learnable")
    config = transformer_config(args, SimpleNamespace(layout=Layout(tp=1, pp=1, dp=1)),
                                ModelConfig(hf_config=hf, transformer_impl="local"))
    spec = layer_spec(config, use_te=False, vp_stage=None, pp_rank=0)
    core = spec.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert core is SDPACoreAttention
    layers = [core(config, layer_number=n, attn_mask_type=AttnMaskType.causal, attention_type="self")
              for n in range(1, config.num_layers + 1)]
    assert [a.window for a in layers] == [(2, 0), None, (2, 0), None]
    assert all(a.softmax_offset.shape == (config.num_attention_heads,) for a in layers)
