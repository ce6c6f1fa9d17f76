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
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megarl.parallel.context import cp_chunk_starts, gather_sequence


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    # True where attention is allowed; query i sits at absolute position sk - sq + i.
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    return k_pos <= q_pos  # [sq, sk]


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

    def _attend(self, q, k, v, mask, causal: bool):
        # q: [b, np, sq, hn], k: [b, ng, sk, hn], v: [b, ng, sk, hv]
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
            mask = _causal_mask(sq, sk, q.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dropout(), scale=self.softmax_scale)

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
        # query: [sq, b, np, hn]; key/value: [sk, b, ng, hn]
        allowed = None
        if attention_mask is not None:
            allowed = ~attention_mask.bool()  # Megatron masks are True where attention is blocked
            if causal:
                allowed = allowed & _causal_mask(query.shape[0], key.shape[0], query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v, allowed, causal)  # [b, np, sq, hv]
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
            out[q0:q1] = self._attend(q, k, v, None, causal)[0].transpose(0, 1)
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
            # Keys past this chunk's end are all in its future: attend to the prefix, with the
            # causal mask aligned to the prefix's end.
            end = start + chunk if causal else seq
            allowed = None
            if attention_mask is not None:
                allowed = ~attention_mask[:, :, i * chunk:(i + 1) * chunk, :end].bool()
                if causal:
                    allowed = allowed & _causal_mask(chunk, end, query.device)
            args = (q[:, :, i * chunk:(i + 1) * chunk], k[:, :, :end], v[:, :, :end], allowed, causal)
            if torch.is_grad_enabled():
                # SDPA would save the chunk's causal mask as floats for the backward, O(s²/cp) per
                # layer (benchmarks/long_context.py); recomputing the attention in the backward
                # keeps only q, k, v, which are held anyway
                outs.append(torch.utils.checkpoint.checkpoint(self._attend, *args, use_reentrant=False))
            else:
                outs.append(self._attend(*args))
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
            for start in starts:
                end = start + chunk if causal else length
                q = query[local:local + chunk].transpose(0, 1).unsqueeze(0)
                k = key[seq_start:seq_start + end].transpose(0, 1).unsqueeze(0)
                v = value[seq_start:seq_start + end].transpose(0, 1).unsqueeze(0)
                out[local:local + chunk] = self._attend(q, k, v, None, causal)[0].transpose(0, 1)
                local += chunk
        return out.reshape(out.shape[0], -1)  # [t/cp, np*hv]
