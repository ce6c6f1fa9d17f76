"""Micro-batches for the engines: fixed-size or by token budget, padded or packed.

A batch is a dict of [rows, seq] tensors (MoE ``routing``: [rows, seq, layers, topk]) with right
padding (``lengths`` [rows] gives each row's real tokens). Micro-batches keep the indices of their
rows so results go back in order. Packed micro-batches concatenate the real tokens of their rows
into one row (THD format, ``cu_seqlens``), so no compute is spent on padding.

With context parallelism each micro-batch's sequences are later split over the CP ranks
(:mod:`megarl.parallel.context`), so a padded micro-batch's width, and each sequence of a
packed one, is a multiple of 2·cp (``segment_multiple``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

Tensors = Dict[str, torch.Tensor]  # an engine batch: name -> [rows, seq] (see the module docstring)


@dataclass
class MicroBatch:
    """Rows of a batch and the tensors fed to the model for them."""

    rows: torch.Tensor  # [n] indices into the batch
    tensors: Tensors  # [n, s] (padded) or [1, T] (packed)
    packed_seq_params: Optional[object] = None  # megatron PackedSeqParams when packed
    lengths: Optional[torch.Tensor] = None  # [n] real tokens of each row

    @property
    def num_tokens(self) -> int:
        return int(self.tensors["tokens"].numel())


def balance_across_dp(lengths: torch.Tensor, dp: int) -> List[torch.Tensor]:
    """Assign rows to ``dp`` bins (data-parallel ranks, or micro-batches) so each gets a similar
    number of real tokens (longest first, to the least loaded bin; ties to the lower). Deterministic."""
    loads = [0] * dp
    assigned: List[List[int]] = [[] for _ in range(dp)]
    for row in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        rank = min(range(dp), key=lambda k: (loads[k], k))
        assigned[rank].append(row)
        loads[rank] += int(lengths[row])
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in assigned]


def take_rows(batch: Tensors, rows: torch.Tensor) -> Tensors:
    return {k: v[rows] for k, v in batch.items()}


def fixed_micro_batches(batch: Tensors, micro_batch_size: int) -> List[torch.Tensor]:
    """Row groups of ``micro_batch_size`` in order."""
    rows = batch["tokens"].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows do not split into micro-batches of {micro_batch_size}")
    return [torch.arange(i, i + micro_batch_size) for i in range(0, rows, micro_batch_size)]


def token_budget_micro_batches(lengths: torch.Tensor, max_tokens: int) -> List[torch.Tensor]:
    """Row groups whose real tokens fit ``max_tokens`` (first-fit over rows sorted by length,
    longest first). A row longer than the budget gets a micro-batch of its own."""
    bins: List[List[int]] = []
    loads: List[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        n = int(lengths[row])
        for i, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[i].append(row)
                loads[i] += n
                break
        else:
            bins.append([row])
            loads.append(n)
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def padded(batch: Tensors, rows: torch.Tensor, lengths: torch.Tensor, multiple: int) -> MicroBatch:
    """The rows, cut to their longest real length rounded up to ``multiple`` (sequence and
    context parallelism), right-padded past the batch width if that is not a multiple."""
    longest = int(lengths[rows].max())
    longest = -(-longest // multiple) * multiple
    micro = MicroBatch(rows, {k: v[rows, :longest] for k, v in batch.items()}, lengths=lengths[rows])
    return pad_to(micro, longest)


def packed(batch: Tensors, rows: torch.Tensor, lengths: torch.Tensor, multiple: int,
           segment_multiple: int = 1) -> MicroBatch:
    """The rows' real tokens end to end in one row; a padding segment makes the total divide
    by ``multiple`` (sequence parallelism). Positions restart at every sequence.

    ``segment_multiple`` (2·cp with context parallelism): each sequence is padded to a multiple
    of it, as Megatron's THD context parallelism needs; ``cu_seqlens_*_padded`` then hold the
    padded bounds and ``cu_seqlens_*`` the real ones."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [int(lengths[r]) for r in rows]
    padded_lens = [-(-n // segment_multiple) * segment_multiple for n in lens]
    pad = -sum(padded_lens) % multiple
    seg_lens = padded_lens + ([pad] if pad else [])
    tensors = {}
    for key, value in batch.items():
        parts = []
        for r, n, p in zip(rows.tolist(), lens, padded_lens):
            parts.append(value[r, :n])
            if p > n:
                parts.append(value.new_full((p - n, *value.shape[2:]), _pad_value(key)))
        if pad:
            parts.append(value.new_full((pad, *value.shape[2:]), _pad_value(key)))
        tensors[key] = torch.cat(parts).unsqueeze(0)
    # positions and bounds where the tokens are: attention kernels read cu_seqlens on the device
    device = tensors["tokens"].device
    tensors["position_ids"] = torch.cat([torch.arange(n, device=device) for n in seg_lens]).unsqueeze(0)
    cu = _cumulative(seg_lens).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(seg_lens), max_seqlen_kv=max(seg_lens))
    if segment_multiple > 1:
        real = _cumulative(lens + ([pad] if pad else [])).to(device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=max(seg_lens), max_seqlen_kv=max(seg_lens))
    return MicroBatch(rows, tensors, params, torch.tensor(lens))


def _cumulative(lengths: List[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def segment_lengths(micro: MicroBatch) -> List[int]:
    """Lengths of the sequences a micro-batch's tensors hold along dim 1, padding included: the
    width for padded rows, each (padded) segment for a packed row."""
    params = micro.packed_seq_params
    if params is None:
        return [micro.tensors["tokens"].shape[1]]
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return (cu[1:] - cu[:-1]).tolist()


def _pad_value(key: str) -> int:
    """Padding of a batch tensor: 0, but -1 (no token) in MoE ``routing``."""
    return -1 if key == "routing" else 0


def pad_to(micro: MicroBatch, width: int) -> MicroBatch:
    """Right-pad a micro-batch's tensors to ``width`` columns (masked, after every real token);
    a packed row gets the padding as one more segment."""
    extra = width - micro.tensors["tokens"].shape[1]
    if extra <= 0:
        return micro
    # pad dim 1 (F.pad's spec runs from the last dim): [n, s] tensors and [n, s, layers, topk] routing
    tensors = {k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, extra), value=_pad_value(k))
               for k, v in micro.tensors.items()}
    params = micro.packed_seq_params
    if params is not None:
        from dataclasses import replace

        cu = torch.cat([params.cu_seqlens_q, params.cu_seqlens_q[-1:] + extra])
        tensors["position_ids"][:, -extra:] = torch.arange(extra)
        params = replace(params, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(params.max_seqlen_q, extra),
                         max_seqlen_kv=max(params.max_seqlen_kv, extra))
        if params.cu_seqlens_q_padded is not None:
            padded_cu = torch.cat([params.cu_seqlens_q_padded, params.cu_seqlens_q_padded[-1:] + extra])
            params = replace(params, cu_seqlens_q_padded=padded_cu, cu_seqlens_kv_padded=padded_cu)
    else:
        last = micro.tensors["position_ids"][:, -1:]
        tensors["position_ids"][:, -extra:] = last + torch.arange(1, extra + 1)
    return MicroBatch(micro.rows, tensors, params, micro.lengths)


def unpack(values: torch.Tensor, micro: MicroBatch, seq: int) -> torch.Tensor:
    """Per-token values of a micro-batch back to [n, seq] rows (zeros past each length)."""
    out = values.new_zeros(len(micro.rows), seq)
    if micro.packed_seq_params is None:
        for i, n in enumerate(micro.lengths.tolist()):
            out[i, :n] = values[i, :n]
        return out
    flat = values.reshape(-1)
    starts = torch.tensor([0] + segment_lengths(micro)).cumsum(0).tolist()
    for i, n in enumerate(micro.lengths.tolist()):
        out[i, :n] = flat[starts[i]:starts[i] + n]
    return out
