"""Delta weight sync (``parallel.rollout.weight_sync=delta``): send only the elements whose bits
changed since the last sync, exactly.

At the learning rates of large-model RL one optimizer step moves a weight by far less than one
bf16 rounding step, so after the cast to the rollout's dtype only the few values that crossed a
rounding boundary differ from what the rollout already holds. A sender keeps the last message it
sent to each peer (in the wire dtype, the receiver's); the next message for the same ranges is
compared with it bit by bit (integer views: -0.0, NaN payloads and all count as bits) and encoded
as the smallest of:

- ``dense``: the whole message (the first sync, or when most of it changed);
- ``gaps``: per changed element the distance from the previous one in one byte (255 escapes a
  further 255 without a value), then the values: ``nnz * (1 + itemsize)`` plus the escapes;
  the smallest from the sparsest messages up to about a third changed;
- ``bitmask``: one bit per element, then the changed values (``numel / 8 + nnz * itemsize``),
  smaller than ``gaps`` when more than about 1/8 of the elements changed;
- ``indices``: int32 positions, then the values (``nnz * (4 + itemsize)``), smaller than ``gaps``
  only when changes are more than ~800 elements apart.

Each message is preceded by a three-int64 header (encoding, changed count, escapes): the receiver
learns the payload's size before posting its receive. The receiver rebuilds the message's previous
values from the tensors it filled last time, applies the change in place and copies out as for
a dense message, so a delta sync leaves every rollout tensor bit-identical to a full one.

Why not xor plus a general compressor (zstd, zlib): the xor of two bf16 tensors is mostly zero
bytes, but a byte compressor runs on the host, one core, at tens to hundreds of MB/s; these
encodings are tensor ops wherever the buffers live (GPU included), and benchmarks/reshard.py
prints their sizes and times beside zlib's on the same messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, Hashable, Optional, Tuple

import torch

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
HEADER_ELEMS = 3  # (encoding, changed elements, escape bytes), int64
_ESCAPE = 255


class Encoding(enum.IntEnum):
    dense = 0
    indices = 1
    bitmask = 2
    gaps = 3


def _prefix_bytes(kind: Encoding, numel: int, nnz: int, escapes: int) -> int:
    """Bytes before the values (positions, gaps or mask), padded to 8 so that the values stay aligned."""
    raw = {Encoding.indices: nnz * 4, Encoding.bitmask: (numel + 7) // 8, Encoding.gaps: nnz + escapes}[kind]
    return (raw + 7) // 8 * 8


def payload_bytes(kind: Encoding, numel: int, nnz: int, itemsize: int, escapes: int = 0) -> int:
    """Bytes of a message of ``numel`` elements with ``nnz`` changed, in encoding ``kind``
    (``escapes``: the gaps encoding's escape bytes)."""
    if kind == Encoding.dense:
        return numel * itemsize
    return _prefix_bytes(kind, numel, nnz, escapes) + nnz * itemsize


def choose(numel: int, nnz: int, itemsize: int, escapes: int) -> Encoding:
    """The smallest encoding (the simpler on ties: dense, indices, bitmask, gaps)."""
    sizes = {kind: payload_bytes(kind, numel, nnz, itemsize, escapes) for kind in Encoding}
    if numel >= 2**31:  # int32 positions
        sizes.pop(Encoding.indices)
    return min(sizes, key=lambda kind: (sizes[kind], kind))


def _gaps(where: torch.Tensor) -> torch.Tensor:
    """Elements skipped before each changed one (``where``: positions, ascending, int64)."""
    return torch.diff(where, prepend=where.new_full((1,), -1)) - 1


def encode_gaps(gaps: torch.Tensor) -> torch.Tensor:
    """Each gap as ``gap // 255`` escape bytes (255) and one byte ``gap % 255``."""
    runs = gaps // _ESCAPE + 1
    out = torch.full((int(runs.sum()),), _ESCAPE, dtype=torch.uint8, device=gaps.device)
    out[torch.cumsum(runs, 0) - 1] = (gaps % _ESCAPE).to(torch.uint8)
    return out


def decode_gaps(data: torch.Tensor) -> torch.Tensor:
    """Positions (int64) from :func:`encode_gaps`' bytes."""
    escape = data == _ESCAPE
    final = (~escape).nonzero().view(-1)
    escapes = torch.cumsum(escape.long(), 0)[final]
    gaps = _ESCAPE * torch.diff(escapes, prepend=escapes.new_zeros(1)) + data[final].long()
    return torch.cumsum(gaps + 1, 0) - 1


def _bits(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_VIEWS[flat.element_size()])


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, element i in bit i % 8 of byte i // 8."""
    pad = (-mask.numel()) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    out = bits[:, 0].clone()
    for i in range(1, 8):
        out |= bits[:, i] << i
    return out


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].bool()


@dataclass
class Encoded:
    """One message: its header (on the message's device) and payload bytes."""

    header: torch.Tensor
    payload: torch.Tensor  # uint8
    kind: Encoding
    nnz: int
    scratch_bytes: int  # temporaries of the encode (mask, positions), for peak accounting
    message_bytes: int  # the dense message encoded

    @property
    def transient_bytes(self) -> int:
        """Bytes the encode held besides the payload: its temporaries, and the dense message when
        the payload is not the message itself."""
        return self.scratch_bytes + (0 if self.kind == Encoding.dense else self.message_bytes)


def encode(new: torch.Tensor, last: Optional[torch.Tensor]) -> Encoded:
    """``new`` (flat, contiguous) against ``last`` (the previous message for the same ranges, same
    dtype and size; None: dense)."""
    numel, itemsize = new.numel(), new.element_size()
    escapes = 0
    if last is None or last.numel() != numel or last.dtype != new.dtype:
        kind, nnz, payload, scratch = Encoding.dense, numel, new.view(torch.uint8), 0
    else:
        changed = _bits(new) != _bits(last)
        nnz = int(changed.sum())
        scratch = numel  # the mask
        kind = choose(numel, nnz, itemsize, 0)  # positions cost at least what gaps without escapes do
        if kind in (Encoding.gaps, Encoding.indices):  # then fewer than 1/8 changed: positions stay small
            where = changed.nonzero().view(-1)
            gaps = _gaps(where)
            escapes = int((gaps // _ESCAPE).sum())
            kind = choose(numel, nnz, itemsize, escapes)
            scratch += nnz * 16  # positions and gaps (int64)
        if kind == Encoding.dense:
            payload = new.view(torch.uint8)
        else:
            if kind == Encoding.indices:
                prefix = where.to(torch.int32).view(torch.uint8)
            elif kind == Encoding.gaps:
                prefix = encode_gaps(gaps)
            else:
                prefix = pack_bits(changed)
            payload = torch.zeros(payload_bytes(kind, numel, nnz, itemsize, escapes), dtype=torch.uint8,
                                  device=new.device)
            payload[:prefix.numel()] = prefix
            payload[_prefix_bytes(kind, numel, nnz, escapes):] = new[changed].view(torch.uint8)
    header = torch.tensor([int(kind), nnz, escapes], dtype=torch.int64, device=new.device)
    return Encoded(header, payload, kind, nnz, scratch, numel * itemsize)


def empty_header(device) -> torch.Tensor:
    return torch.zeros(HEADER_ELEMS, dtype=torch.int64, device=device)


def read_header(header: torch.Tensor, numel: int, itemsize: int) -> Tuple[Tuple[Encoding, int, int], int]:
    """((encoding, changed elements, escapes), payload bytes) of a received header."""
    kind, nnz, escapes = (int(x) for x in header.tolist())
    kind = Encoding(kind)
    return (kind, nnz, escapes), payload_bytes(kind, numel, nnz, itemsize, escapes)


def apply(message: Tuple[Encoding, int, int], payload: torch.Tensor, dtype: torch.dtype, previous) -> torch.Tensor:
    """The message's new values (flat, ``dtype``): the payload itself when dense, else
    ``previous()`` (the receiver's current values of the ranges, flat: built only when needed)
    updated in place."""
    kind, nnz, escapes = message
    if kind == Encoding.dense:
        return payload.view(dtype)
    previous = previous()
    numel = previous.numel()
    if nnz == 0:
        return previous
    values = payload[_prefix_bytes(kind, numel, nnz, escapes):].view(dtype)
    if kind == Encoding.indices:
        previous[payload[:nnz * 4].view(torch.int32).long()] = values
    elif kind == Encoding.gaps:
        previous[decode_gaps(payload[:nnz + escapes])] = values
    else:
        previous[unpack_bits(payload[:(numel + 7) // 8], numel)] = values
    return previous


class LastSent:
    """The sender's copy of the last message per key (the ranges it covers): what the receiver holds.
    Keys not used by a sync are dropped at its end (their ranges changed)."""

    def __init__(self):
        self.copies: Dict[Hashable, torch.Tensor] = {}
        self.used: set = set()

    def encode(self, key: Hashable, new: torch.Tensor) -> Encoded:
        last = self.copies.get(key)
        out = encode(new, last)
        if last is None or last.numel() != new.numel() or last.dtype != new.dtype:
            self.copies[key] = new.clone()
        elif out.nnz:
            self.copies[key].copy_(new)
        self.used.add(key)
        return out

    def end_sync(self) -> None:
        for key in set(self.copies) - self.used:
            del self.copies[key]
        self.used.clear()

    def clear(self) -> None:
        self.copies.clear()
        self.used.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())
