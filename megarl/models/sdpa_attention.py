"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``: the local-spec
replacement for Megatron's CUDA-only ``DotProductAttention``.

Handles causal masks aligned to the end of the key sequence (so a KV cache of earlier tokens
works), grouped-query attention, explicit boolean masks and packed sequences (``thd`` format
with ``cu_seqlens``), in the same call signature Megatron's attention modules use.

Context parallelism (cp > 1): each rank holds, of every sequence, chunks ``r`` and
``2cp-1-r`` of ``2cp`` equal chunks (Megatron's load-balanced order, ``get_batch_on_this_cp_rank``).
Keys and values are all-gathered over the CP group (autograd-aware: the backward sums each
rank's key/value gradients back to their owner) and put back in sequence order; each local
query chunk then attends causally to the keys up to its own end.

Sliding windows and attention sinks, in Megatron's ``TransformerConfig`` terms.
``window_size=(left, right)``: query position i attends keys i-left..i+right (-1: no bound on
that side; a causal layer also stops at i; an HF ``sliding_window`` W is (W-1, 0)), on the
layers ``window_attn_skip_freq`` leaves sliding (Megatron's ``is_layer_window_attention``).
Positions are those of the query's own sequence: aligned to the end of the keys (KV cache),
relative to each packed sequence's start, absolute after the CP gather. Keys outside every
query's window are not read. ``softmax_type='learnable'``: a per-head logit, the parameter
``softmax_offset`` [heads/tp] (split over TP with the heads, as in Megatron's
``DotProductAttention``), joins the softmax over the keys as one more column that is dropped
afterwards; ``'off-by-one'`` fixes that logit at 0. SDPA has no such column, so attention with
sinks is an explicit matmul-softmax.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group, is_layer_window_attention, make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide

from megarl.parallel.context import cp_chunk_starts, gather_sequence

Window = Tuple[Optional[int], Optional[int]]  # (left, right) key offsets from the query; None: unbounded


def _layer_window(config, layer_number: int) -> Optional[Window]:
    """This layer's window, or None for full attention, decided as Megatron decides it
    (``layer_number`` is 1-based and global, as Megatron's attention passes it)."""
    window, skip = config.window_size, config.window_attn_skip_freq
    if window and isinstance(skip, list) and len(skip) < layer_number:
        raise ValueError(f"window_attn_skip_freq lists {len(skip)} layers but layer {layer_number} needs an "
                         "entry: give one per layer (1 = sliding window, 0 = full attention)")
    if not is_layer_window_attention(window, skip, layer_number):
        return None
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        raise ValueError(f"window_size={window!r} must be (left, right), each -1 (unbounded) or >= 0; "
                         "an HF sliding_window W is window_size=(W-1, 0)")
    return tuple(None if w == -1 else w for w in window)


def _band(sq: int, sk: int, q_start: int, causal: bool, window: Optional[Window], device) -> Optional[torch.Tensor]:
    """[1, 1, sq, sk] bool, True where query i (at key position q_start + i) may attend key j:
    not after it if ``causal``, and inside ``window``; None when nothing is restricted."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    offset = torch.arange(sk, device=device) - torch.arange(q_start, q_start + sq, device=device).unsqueeze(1)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left is not None:
        allowed &= offset >= -left
    if right is not None:
        allowed &= offset <= right
    return allowed.view(1, 1, sq, sk)


class SDPACoreAttention(MegatronModule):
    """Drop-in for Megatron's core attention in local layer specs."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        # k_channels/v_channels (MLA) need no state: SDPA reads head sizes off the tensors.
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection

                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = None
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        # Set by Megatron's qk-clip bookkeeping; SDPA does not expose the logits.
        self.current_max_attn_logits = None
        self.window = _layer_window(config, layer_number)
        if config.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type='{config.softmax_type}' is not supported: use 'vanilla', "
                             "'off-by-one' or 'learnable'")
        self.softmax_type = config.softmax_type
        self.tp_group = self._tp_group(config, pg_collection)
        if self.softmax_type == "learnable":
            self._register_sinks(config)

    @staticmethod
    def _tp_group(config, pg_collection):
        """The tensor-parallel group; None on one TP rank without one (a module built outside
        torch.distributed, as the unit tests do)."""
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            return pg_collection.tp
        if config.tensor_model_parallel_size > 1:
            from megatron.core.process_groups_config import ProcessGroupCollection

            return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]).tp
        return None

    def _register_sinks(self, config) -> None:
        """``softmax_offset`` [heads/tp]: the sink logits of this rank's heads, Megatron's name,
        shape and init method. Marked tensor-parallel (dim 0) so that the gradient norm and
        checkpoints count each rank's heads once. All heads are drawn and this rank's sliced
        out, so every TP layout starts from the same model; zeros (off-by-one) when Megatron
        skips initialisation (weights about to be loaded)."""
        tp, rank = (self.tp_group.size(), self.tp_group.rank()) if self.tp_group is not None else (1, 0)
        heads = divide(config.num_attention_heads, tp)
        every = torch.zeros(config.num_attention_heads, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(every)
        mine = every[rank * heads:(rank + 1) * heads]
        if mine.is_meta:  # built under torch.device("meta") (a pre-flight shape check): no data to copy
            mine = torch.empty(heads, dtype=config.params_dtype, device="meta")
        else:
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            mine = mine.to(device=device, dtype=config.params_dtype)
        self.softmax_offset = torch.nn.Parameter(mine)
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """``softmax_offset`` split over TP along the heads (as Megatron's ``DotProductAttention``)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def _sinks(self, q) -> Optional[torch.Tensor]:
        """The sink logit of each local query head [np], or None (plain softmax)."""
        if self.softmax_type == "learnable":
            return self.softmax_offset
        if self.softmax_type == "off-by-one":
            return q.new_zeros(q.shape[1])
        return None

    def _span(self, q_start: int, sq: int, sk: int, causal: bool) -> Tuple[int, int]:
        """Keys [lo, hi) that queries at key positions q_start..q_start+sq-1 can see: causal
        ones none after the last query, windowed ones none outside the window. The rest is
        never read (a decode step with a window reads the window, not the whole cache)."""
        lo, hi = 0, (q_start + sq if causal else sk)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                lo = max(lo, q_start - left)
            if right is not None:
                hi = min(hi, q_start + sq + right)
        return lo, hi

    def _attend_at(self, q, k, v, q_start: int, causal: bool, allowed=None):
        """Attention of queries at key positions q_start.. of k and v: q [b, np, sq, hn],
        k [b, ng, sk, hn], v [b, ng, sk, hv]; allowed: bool [b, 1, sq, sk] (True = may attend)
        or None. Returns [b, np, sq, hv]."""
        sq, sk = q.shape[2], k.shape[2]
        lo, hi = self._span(q_start, sq, sk, causal)
        k, v = k[:, :, lo:hi], v[:, :, lo:hi]
        q_start, sk = q_start - lo, hi - lo
        if allowed is not None:
            allowed = allowed[..., lo:hi]
        if allowed is None and self.window is None and (not causal or q_start == sk - sq):
            return self._attend(q, k, v, None, causal)  # SDPA's own causal mask (or none)
        band = _band(sq, sk, q_start, causal, self.window, q.device)
        if allowed is None:
            allowed = band
        elif band is not None:
            allowed = allowed & band
        return self._attend(q, k, v, allowed, False)

    def _attend(self, q, k, v, mask, causal: bool):
        # q: [b, np, sq, hn], k: [b, ng, sk, hn], v: [b, ng, sk, hv]
        sinks = self._sinks(q)
        if sinks is not None:
            if causal:
                mask = _band(q.shape[2], k.shape[2], k.shape[2] - q.shape[2], True, None, q.device)
            return self._attend_with_sinks(q, k, v, mask, sinks)
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and q.shape[2] == 1 and not causal and (mask is None or mask.shape[1] == 1):
            # a decode step: a group's query heads act as its queries, so K/V (the whole cache) are
            # read in place instead of copied per head; the head order is repeat_interleave's
            b, ng = k.shape[0], k.shape[1]
            out = F.scaled_dot_product_attention(q.reshape(b, ng, groups, q.shape[3]), k, v, attn_mask=mask,
                                                 dropout_p=self._dropout(), scale=self.softmax_scale)
            return out.reshape(b, ng * groups, 1, v.shape[3])
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is None and causal:
            sq, sk = q.shape[2], k.shape[2]
            if sq == sk:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, dropout_p=self._dropout(), scale=self.softmax_scale)
            mask = _band(sq, sk, sk - sq, True, None, q.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dropout(), scale=self.softmax_scale)

    def _attend_with_sinks(self, q, k, v, mask, sinks):
        """softmax([scores, sink]) without the sink column, times V (Megatron's ``SoftmaxOne``).
        Each KV group's query heads are the rows of one matrix, so K/V are read in place (head
        order as repeat_interleave's). The softmax runs in at least fp32, as Megatron's
        (``attention_softmax_in_fp32``); a query whose keys are all masked gets all its weight
        on the sink and outputs zeros."""
        b, np_, sq, hn = q.shape
        ng, sk = k.shape[1], k.shape[2]
        groups = np_ // ng
        scale = self.softmax_scale if self.softmax_scale is not None else hn ** -0.5
        scores = torch.matmul(q.reshape(b, ng, groups * sq, hn), k.transpose(2, 3)).view(b, ng, groups, sq, sk)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))  # [b|1, 1, 1, sq, sk]
        column = sinks.to(scores.dtype).view(1, ng, groups, 1, 1).expand(b, ng, groups, sq, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        probs = F.dropout(probs, self._dropout()).to(v.dtype)
        return torch.matmul(probs.reshape(b, ng, groups * sq, sk), v).view(b, np_, sq, v.shape[3])

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the SDPA core attention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self.cp_group is not None:
                return self._forward_packed_cp(query, key, value, packed_seq_params, causal)
            return self._forward_packed(query, key, value, packed_seq_params, causal)
        if self.cp_group is not None:
            return self._forward_cp(query, key, value, attention_mask, causal)
        # query: [sq, b, np, hn]; key/value: [sk, b, ng, hn]; the queries are the last sq positions
        allowed = None if attention_mask is None else ~attention_mask.bool()  # Megatron's: True = blocked
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend_at(q, k, v, key.shape[0] - query.shape[0], causal, allowed)  # [b, np, sq, hv]
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np*hv]

    def _forward_packed(self, query, key, value, params, causal: bool):
        # query: [t, np, hn]; sequences are delimited by cu_seqlens (padded variants if given).
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        for i in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
            if q1 == q0:
                continue
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)
            k = key[k0:k1].transpose(0, 1).unsqueeze(0)
            v = value[k0:k1].transpose(0, 1).unsqueeze(0)
            out[q0:q1] = self._attend_at(q, k, v, (k1 - k0) - (q1 - q0), causal)[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)  # [t, np*hv]

    def _forward_cp(self, query, key, value, attention_mask, causal: bool):
        # query: [s/cp, b, np, hn] this rank's two chunks; key/value: [s/cp, b, ng, hn].
        # attention_mask (optional): [b, 1, s/cp, s], queries split like the tokens, keys whole.
        cp = self.cp_group.size()
        if key.shape[0] != query.shape[0]:
            raise ValueError("context parallelism with a KV cache is not supported: decode with cp=1")
        seq = query.shape[0] * cp
        key, value = (gather_sequence(t, self.cp_group, [seq], dim=0) for t in (key, value))  # [s, b, ng, hn]
        chunk, starts = cp_chunk_starts(seq, cp, self.cp_group.rank())
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        outs = []
        for i, start in enumerate(starts):
            # Each chunk attends to the keys it can see (for a causal chunk, the prefix up to its
            # end), its queries at their absolute positions.
            allowed = None if attention_mask is None else ~attention_mask[:, :, i * chunk:(i + 1) * chunk].bool()
            args = (q[:, :, i * chunk:(i + 1) * chunk], k, v, start, causal, allowed)
            if torch.is_grad_enabled():
                # SDPA would save the chunk's causal mask as floats for the backward, O(s²/cp) per
                # layer (benchmarks/long_context.py); recomputing the attention in the backward
                # keeps only q, k, v, which are held anyway
                outs.append(torch.utils.checkpoint.checkpoint(self._attend_at, *args, use_reentrant=False))
            else:
                outs.append(self._attend_at(*args))
        out = torch.cat(outs, dim=2)  # [b, np, s/cp, hv]
        b = query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], b, -1)  # [s/cp, b, np*hv]

    def _forward_packed_cp(self, query, key, value, params, causal: bool):
        # query: [t/cp, np, hn]: of each sequence (lengths from the padded cu_seqlens, multiples
        # of 2cp), this rank's two chunks, sequence after sequence.
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if not torch.equal(cu, cu_k):
            raise ValueError("packed context parallelism needs the same query and key sequences")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        bounds = cu.tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        key, value = (gather_sequence(t, self.cp_group, lengths, dim=0) for t in (key, value))  # [t, ng, hn]
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        local = 0
        for seq_start, length in zip(bounds[:-1], lengths):
            if length == 0:
                continue
            chunk, starts = cp_chunk_starts(length, cp, rank)
            k = key[seq_start:seq_start + length].transpose(0, 1).unsqueeze(0)
            v = value[seq_start:seq_start + length].transpose(0, 1).unsqueeze(0)
            for start in starts:
                q = query[local:local + chunk].transpose(0, 1).unsqueeze(0)
                out[local:local + chunk] = self._attend_at(q, k, v, start, causal)[0].transpose(0, 1)
                local += chunk
        return out.reshape(out.shape[0], -1)  # [t/cp, np*hv]
