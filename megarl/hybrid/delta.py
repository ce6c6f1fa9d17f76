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
import functools
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megarl.hybrid import delta_host as host

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INTS = {2: np.int16, 4: np.int32, 8: np.int64}
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
    if where.device.type == "cpu":
        return _from_numpy(np.diff(where.numpy(), prepend=-1) - 1)
    return torch.diff(where, prepend=where.new_full((1,), -1)) - 1


def _escapes(gaps: torch.Tensor) -> int:
    """Escape bytes :func:`encode_gaps` writes for ``gaps``."""
    if not gaps.numel() or int(gaps.max()) < _ESCAPE:
        return 0
    long = gaps[gaps >= _ESCAPE]  # few: most changed elements are near the previous one
    return int((long // _ESCAPE).sum())


def encode_gaps(gaps: torch.Tensor) -> torch.Tensor:
    """Each gap as ``gap // 255`` escape bytes (255) and one byte ``gap % 255``."""
    if gaps.device.type == "cpu":
        g = gaps.numpy()
        if not g.size or g.max() < _ESCAPE:  # no escapes: a byte per gap
            return _from_numpy(g.astype(np.uint8))
        long = np.flatnonzero(g >= _ESCAPE)  # the few gaps that take escapes
        runs = np.zeros(g.size, dtype=np.int64)
        runs[long] = g[long] // _ESCAPE
        final = np.arange(g.size) + np.cumsum(runs)  # each gap's last byte
        out = np.full(g.size + int(runs[long].sum()), _ESCAPE, dtype=np.uint8)
        out[final] = g - _ESCAPE * runs
        return _from_numpy(out)
    runs = gaps // _ESCAPE + 1
    out = torch.full((int(runs.sum()),), _ESCAPE, dtype=torch.uint8, device=gaps.device)
    out[torch.cumsum(runs, 0) - 1] = (gaps % _ESCAPE).to(torch.uint8)
    return out


def decode_gaps(data: torch.Tensor, escapes: Optional[int] = None) -> torch.Tensor:
    """Positions (int64) from :func:`encode_gaps`' bytes (``escapes``: their escape bytes, when known;
    with none each byte is a gap)."""
    if data.device.type == "cpu":
        d = data.numpy()
        if host.AVAILABLE and escapes is not None:
            return _from_numpy(host.kernels().decode_gaps(d, d.size - escapes))
        if escapes == 0:
            return _from_numpy(np.cumsum(d, dtype=np.int64) + np.arange(1, d.size + 1) - 1)
        final = np.flatnonzero(d != _ESCAPE)
        escapes = final - np.arange(final.size)  # escape bytes before each final byte
        gaps = _ESCAPE * np.diff(escapes, prepend=0) + d[final]
        return _from_numpy(np.cumsum(gaps + 1) - 1)
    if escapes == 0:
        return torch.cumsum(data.long() + 1, 0) - 1
    escape = data == _ESCAPE
    final = (~escape).nonzero().view(-1)
    escapes = torch.cumsum(escape.long(), 0)[final]
    gaps = _ESCAPE * torch.diff(escapes, prepend=escapes.new_zeros(1)) + data[final].long()
    return torch.cumsum(gaps + 1, 0) - 1


def _bits(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_VIEWS[flat.element_size()])


# Host tensors take numpy's vectorised kernels for the passes over a whole message (not-equal,
# flat nonzero, bit packing): on one CPU thread they are 2-5x torch's; device tensors stay in torch.
def _changed(new: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Bool per element: its bits differ."""
    if new.device.type == "cpu":
        return torch.from_numpy(np.not_equal(_bits(new).numpy(), _bits(last).numpy()))
    return _bits(new) != _bits(last)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Indices (int64, ascending) of the true elements."""
    if mask.device.type == "cpu":
        return _from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().view(-1)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, element i in bit i % 8 of byte i // 8."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = (-mask.numel()) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    out = bits[:, 0].clone()
    for i in range(1, 8):
        out |= bits[:, i] << i
    return out


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The bool vector of :func:`pack_bits`."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].bool()


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """A host tensor of ``array``, contiguous (numpy may hand back zero strides for empty results)."""
    if not array.size:
        return torch.empty(0, dtype=torch.from_numpy(array[:0].copy()).dtype)
    return torch.from_numpy(np.ascontiguousarray(array))


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array over a host tensor the engine owns, through DLPack: ``Tensor.numpy()`` would
    mark its storage not resizable for good, and the engines free their weights by resizing it."""
    return np.from_dlpack(tensor)


def _count(mask: torch.Tensor) -> int:
    return int(np.count_nonzero(mask.numpy()) if mask.device.type == "cpu" else torch.count_nonzero(mask))


def _compare(new: torch.Tensor, last: torch.Tensor, itemsize: int, force) -> tuple:
    """(mask or None, positions or None, changed elements, scratch bytes) of ``new`` against ``last``.

    Eight-byte words first: where few words changed, only those words' elements are compared and
    their positions found, without a mask or a pass per element over the message (at a few percent
    changed, about a fifth of the words); otherwise (or when dense is certain) a mask per element."""
    numel = new.numel()
    per_word = 8 // itemsize
    aligned = numel % per_word == 0 and numel >= 64 and new.data_ptr() % 8 == 0 and last.data_ptr() % 8 == 0
    if aligned and new.device.type == "cpu":
        new64, last64 = new.view(torch.int64).numpy(), last.view(torch.int64).numpy()
        at = np.flatnonzero(np.not_equal(new64, last64))  # numpy's nonzero is fastest on bools
        if force is None and choose(numel, at.size, itemsize, 0) == Encoding.dense:
            return None, None, numel, numel // per_word + at.size * 8
        if at.size <= numel // per_word // 2:
            xor = np.bitwise_xor(new64[at], last64[at])
            lanes = np.flatnonzero(xor.view(_NP_INTS[itemsize]) != 0)  # element order within a word
            shift = per_word.bit_length() - 1
            where = _from_numpy((at[lanes >> shift] << shift) | (lanes & (per_word - 1)))
            return None, where, where.numel(), numel // per_word + at.size * 32 + where.numel() * 24
    if aligned:
        xor = torch.bitwise_xor(new.view(torch.int64), last.view(torch.int64))
        words = xor != 0
        changed_words = _count(words)
        if force is None and choose(numel, changed_words, itemsize, 0) == Encoding.dense:
            return None, None, numel, numel * 9 // per_word  # at least one element per changed word: dense wins
        if changed_words <= numel // per_word // 2:  # at most half the words: their positions stay small
            at = _positions(words)
            lanes = xor[at].view(_INT_VIEWS[itemsize]).view(-1, per_word) != 0  # element order within a word
            local = _positions(lanes.view(-1))
            where = at[local // per_word] * per_word + local % per_word
            return None, where, where.numel(), numel * 9 // per_word + changed_words * 16 + where.numel() * 24
    changed = _changed(new, last)
    return changed, None, _count(changed), numel


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


def encode(new: torch.Tensor, last: Optional[torch.Tensor], force: Optional[Encoding] = None) -> Encoded:
    """``new`` (flat, contiguous) against ``last`` (the previous message for the same ranges, same
    dtype and size; None: dense); ``force``: that encoding whatever its size (benchmarks)."""
    numel, itemsize = new.numel(), new.element_size()
    escapes = 0
    fresh = last is None or last.numel() != numel or last.dtype != new.dtype
    if not fresh and new.device.type == "cpu" and host.AVAILABLE:
        out = _encode_host(new, last, force)
        if out is not None:
            return out
    if fresh:
        kind, nnz, payload, scratch = Encoding.dense, numel, new.view(torch.uint8), 0
    else:
        changed, where, nnz, scratch = _compare(new, last, itemsize, force)
        kind = force or choose(numel, nnz, itemsize, 0)  # positions cost at least what gaps without escapes do
        if kind != Encoding.dense and where is None:
            where = _positions(changed)
        if kind != Encoding.dense:
            scratch += nnz * 16  # positions and gaps (int64)
            gaps = _gaps(where)
            escapes = _escapes(gaps) if kind == Encoding.gaps else 0
            if kind == Encoding.gaps:
                kind = force or choose(numel, nnz, itemsize, escapes)
            escapes = escapes if kind == Encoding.gaps else 0  # the header carries escapes of gaps only
        if kind == Encoding.dense:
            payload, escapes, where = new.view(torch.uint8), 0, None
        else:
            if kind == Encoding.indices:
                prefix = where.to(torch.int32).view(torch.uint8)
            elif kind == Encoding.gaps:
                prefix = encode_gaps(gaps)
            else:
                if changed is None:
                    changed = torch.zeros(numel, dtype=torch.bool, device=new.device)
                    changed[where] = True
                prefix = pack_bits(changed)
            payload = torch.empty(payload_bytes(kind, numel, nnz, itemsize, escapes), dtype=torch.uint8,
                                  device=new.device)
            offset = _prefix_bytes(kind, numel, nnz, escapes)
            payload[:prefix.numel()] = prefix
            payload[prefix.numel():offset] = 0
            torch.index_select(new, 0, where, out=payload[offset:].view(new.dtype))
    header = torch.tensor([int(kind), nnz, escapes], dtype=torch.int64, device=new.device)
    return Encoded(header, payload, kind, nnz, scratch, numel * itemsize)


def _encode_host(new: torch.Tensor, last: torch.Tensor, force: Optional[Encoding]) -> Optional[Encoded]:
    """:func:`encode` of host tensors by the compiled passes (``delta_kernels``): one pass writes the
    bitmask and the changed values into a message-sized buffer laid out as a bitmask payload, and the
    chosen encoding is taken from it (the bitmask payload as it is, the gaps or positions derived
    from the mask, or the message itself when dense is smaller). The buffer's pages are touched only
    as far as the pass writes (the scratch counted). None for messages of under 64 elements (the
    NumPy passes)."""
    numel, itemsize = new.numel(), new.element_size()
    if numel < 64:
        return None
    kernels, ints = host.kernels(), _INT_VIEWS[itemsize]
    head = _prefix_bytes(Encoding.bitmask, numel, 0, 0)  # the mask: one uint64 per 64 elements
    buf = torch.empty(numel * itemsize, dtype=torch.uint8)
    mask = buf[:head].numpy().view(np.uint64)
    values = buf[head:head + (numel * itemsize - head) // itemsize * itemsize].view(ints)
    nnz, escapes = kernels.bitmask(_bits(new).numpy(), _bits(last).numpy(), mask, values.numpy())
    scratch = head + values.numel() * itemsize if nnz < 0 else head + nnz * itemsize
    if nnz < 0:  # more changed than a bitmask payload holds: dense is smaller
        if force not in (None, Encoding.dense):
            return None
        kind, nnz, escapes = Encoding.dense, numel, 0
    else:
        kind = force or choose(numel, nnz, itemsize, escapes)
    if kind == Encoding.dense:
        header = torch.tensor([int(kind), nnz, 0], dtype=torch.int64)
        return Encoded(header, new.view(torch.uint8), kind, nnz, scratch, numel * itemsize)
    if kind == Encoding.bitmask:
        payload, scratch = buf[:head + nnz * itemsize], 0  # the payload is the buffer
    else:
        payload = torch.empty(payload_bytes(kind, numel, nnz, itemsize, escapes), dtype=torch.uint8)
        offset = _prefix_bytes(kind, numel, nnz, escapes)
        if kind == Encoding.gaps:
            kernels.mask_gaps(mask, payload[:nnz + escapes].numpy())
            start = nnz + escapes
        else:
            payload[:nnz * 4].view(torch.int32).copy_(torch.from_numpy(kernels.mask_positions(mask, nnz)))
            start = nnz * 4
        payload[start:offset] = 0
        payload[offset:].view(ints).copy_(values[:nnz])
    header = torch.tensor([int(kind), nnz, escapes if kind == Encoding.gaps else 0], dtype=torch.int64)
    return Encoded(header, payload, kind, nnz, scratch, numel * itemsize)


def empty_header(device) -> torch.Tensor:
    return torch.zeros(HEADER_ELEMS, dtype=torch.int64, device=device)


def read_header(header: torch.Tensor, numel: int, itemsize: int) -> Tuple[Tuple[Encoding, int, int], int]:
    """((encoding, changed elements, escapes), payload bytes) of a received header."""
    kind, nnz, escapes = (int(x) for x in header.tolist())
    kind = Encoding(kind)
    return (kind, nnz, escapes), payload_bytes(kind, numel, nnz, itemsize, escapes)


def decode(message: Tuple[Encoding, int, int], payload: torch.Tensor, dtype: torch.dtype,
           numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, values) of a message that is not dense."""
    kind, nnz, escapes = message
    values = payload[_prefix_bytes(kind, numel, nnz, escapes):].view(dtype)
    if kind == Encoding.indices:
        return payload[:nnz * 4].view(torch.int32).long(), values
    if kind == Encoding.gaps:
        return decode_gaps(payload[:nnz + escapes], escapes), values
    if payload.device.type == "cpu" and host.AVAILABLE:
        mask = payload[:_prefix_bytes(kind, numel, nnz, escapes)].numpy().view(np.uint64)
        return _from_numpy(host.kernels().mask_positions(mask, nnz)), values
    return _positions(unpack_bits(payload[:(numel + 7) // 8], numel)), values


def _collapsed(shape: Sequence[int], strides: Sequence[int]) -> List[Tuple[int, int]]:
    """(size, stride) per dim of a view, adjacent dims merged where they are contiguous with each
    other (a range along dim d of a contiguous tensor: two dims, the inner one of stride 1)."""
    dims: List[Tuple[int, int]] = []
    for size, stride in reversed(list(zip(shape, strides))):
        if size == 1:
            continue
        if dims and dims[0][1] * dims[0][0] == stride:
            dims[0] = (dims[0][0] * size, dims[0][1])
        else:
            dims.insert(0, (size, stride))
    return dims


@functools.lru_cache(maxsize=4096)
def _geometry(shape: Tuple[int, ...], stride: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray]:
    """The merged (sizes, strides) of a view of this shape and stride as int64 arrays (the host
    scatter's arguments; a model's views repeat every sync)."""
    dims = _collapsed(shape, stride) or [(1, 1)]
    sizes, strides = (np.array(d, np.int64) for d in zip(*dims))
    sizes.flags.writeable = strides.flags.writeable = False  # shared by every caller
    return sizes, strides


def _offsets(flat: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Row-major indices into ``view`` as offsets from its first element in its storage (one divmod
    per dim after merging the contiguous ones)."""
    dims = _collapsed(view.shape, view.stride())
    on_host = flat.device.type == "cpu"
    index = flat.numpy() if on_host else flat
    out = None
    for size, stride in reversed(dims[1:]):
        index, within = (np.divmod(index, size) if on_host else (index // size, index % size))
        part = within * stride
        out = part if out is None else out + part
    last = index * dims[0][1] if dims else index * 0
    out = last if out is None else out + last
    return _from_numpy(out) if on_host else out


def _strided(view: torch.Tensor) -> torch.Tensor:
    """A flat view of the storage ``view`` spans, from its first element."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    return view.as_strided((span,), (1,))


def apply(message: Tuple[Encoding, int, int], payload: torch.Tensor, dtype: torch.dtype,
          dests: Sequence[torch.Tensor]) -> None:
    """Write a received message into ``dests`` (the tensors, or views, its ranges fill, in order):
    a dense one whole, a delta only at its changed elements (views that are not contiguous take
    them by their multi-dimensional index)."""
    kind, nnz, _ = message
    if kind == Encoding.dense:
        flat, offset = payload.view(dtype), 0
        for dest in dests:
            dest.copy_(flat[offset:offset + dest.numel()].view(dest.shape))
            offset += dest.numel()
        return
    if nnz == 0:
        return
    sizes = [dest.numel() for dest in dests]
    where, values = decode(message, payload, dtype, sum(sizes))
    starts = np.cumsum([0] + sizes).tolist()
    bounds = torch.searchsorted(where, torch.tensor(starts, device=where.device)).tolist()
    if where.device.type == "cpu" and host.AVAILABLE and dtype.itemsize in _INT_VIEWS:
        ints = _INT_VIEWS[dtype.itemsize]
        positions, vals, scatter = where.numpy(), values.view(ints).numpy(), host.kernels().scatter
        for dest, start, lo, hi in zip(dests, starts, bounds, bounds[1:]):
            if hi > lo:
                scatter(positions, vals, lo, hi, start, _host_array(_strided(dest.detach()).view(ints)),
                        *_geometry(tuple(dest.shape), dest.stride()))
        return
    for dest, start, lo, hi in zip(dests, starts, bounds, bounds[1:]):
        if hi == lo:
            continue
        local = where[lo:hi] - start
        if dest.is_contiguous():
            dest.view(-1).index_copy_(0, local, values[lo:hi])
        else:  # a strided view (a range along a later dim): its elements' offsets in the storage
            _strided(dest).index_copy_(0, _offsets(local, dest), values[lo:hi])


class LastSent:
    """The sender's copy of the last message per key (the ranges it covers): what the receiver holds.
    Keys not used by a sync are dropped at its end (their ranges changed)."""

    def __init__(self):
        self.copies: Dict[Hashable, torch.Tensor] = {}
        self.used: set = set()

    def encode(self, key: Hashable, new: torch.Tensor) -> Encoded:
        """``new``: a buffer the caller hands over (it becomes the copy: no copy is made)."""
        out = encode(new, self.copies.get(key))
        self.copies[key] = new
        self.used.add(key)
        return out

    def end_sync(self) -> None:
        for key in set(self.copies) - self.used:
            del self.copies[key]
        self.used.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())
