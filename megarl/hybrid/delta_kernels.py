"""The compiled host passes of the delta codec (numba), imported on first use through
``megarl.hybrid.delta_host.kernels()`` so that a process that never encodes a delta never imports
numba. See ``delta_host`` for the wire format they write.

The sender's pass (:func:`bitmask`) reads the message and its last copy once, 64 elements at a
time: their not-equal bits form one 64-bit word of the mask (a loop the compiler vectorises),
and only the set bits are visited (trailing-zero count), so the work beyond the compare is per
changed element, not per element. The gaps and positions encodings are then derived from the mask.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

ESCAPE = 255
_jit = numba.njit(cache=True, nogil=True)


@_jit
def bitmask(new, last, mask, values):  # pragma: no cover - compiled
    """The changed elements of ``new`` against ``last``: bit i % 64 of ``mask[i // 64]`` (uint64,
    so the mask's bytes are the little-endian bitmask), their values in order into ``values``.
    Returns (changed, escape bytes of their gaps), or (-1, 0) once ``values`` would overflow."""
    n, cap = new.size, values.size
    k, escapes, prev = 0, 0, -1
    for block in range((n + 63) // 64):
        base = block * 64
        word = np.uint64(0)
        if base + 64 <= n:  # a fixed trip count, vectorised
            for lane in range(64):
                word |= np.uint64(new[base + lane] != last[base + lane]) << np.uint64(lane)
        else:
            for lane in range(n - base):
                word |= np.uint64(new[base + lane] != last[base + lane]) << np.uint64(lane)
        mask[block] = word
        while word:
            if k == cap:
                return -1, 0
            i = base + trailing_zeros(word)
            word &= word - np.uint64(1)
            gap = i - prev - 1
            if gap >= ESCAPE:
                escapes += gap // ESCAPE
            values[k] = new[i]
            k += 1
            prev = i
    return k, escapes


@_jit
def mask_gaps(mask, prefix):  # pragma: no cover - compiled
    """The gap bytes of the set bits of ``mask`` into ``prefix`` (changed + escapes bytes)."""
    j, prev = 0, -1
    for block in range(mask.size):
        word = mask[block]
        while word:
            i = block * 64 + trailing_zeros(word)
            word &= word - np.uint64(1)
            gap = i - prev - 1
            while gap >= ESCAPE:
                prefix[j] = ESCAPE
                j += 1
                gap -= ESCAPE
            prefix[j] = gap
            j += 1
            prev = i


@_jit
def mask_positions(mask, nnz):  # pragma: no cover - compiled
    """Positions (int64, ascending) of the ``nnz`` set bits of ``mask``."""
    out = np.empty(nnz, np.int64)
    k = 0
    for block in range(mask.size):
        word = mask[block]
        while word:
            out[k] = block * 64 + trailing_zeros(word)
            word &= word - np.uint64(1)
            k += 1
    return out


@_jit
def decode_gaps(data, nnz):  # pragma: no cover - compiled
    """Positions (int64, ascending) of the ``nnz`` changed elements of gap bytes ``data``."""
    out = np.empty(nnz, np.int64)
    pos, j = -1, 0
    for k in range(nnz):
        gap = 0
        while data[j] == ESCAPE:
            gap += ESCAPE
            j += 1
        gap += data[j]
        j += 1
        pos += gap + 1
        out[k] = pos
    return out


@_jit
def scatter(positions, values, lo, hi, start, out, sizes, strides):  # pragma: no cover - compiled
    """``out[offset(positions[k] - start)] = values[k]`` for k in [lo, hi): ``out`` is the
    flat storage a view spans from its first element, the offset of a row-major index is
    taken over the view's (merged) ``sizes`` and ``strides``."""
    nd = sizes.size
    if nd == 1:
        s0 = strides[0]
        for k in range(lo, hi):
            out[(positions[k] - start) * s0] = values[k]
        return
    if nd == 2:  # a range along the last dim: rows and columns followed without dividing
        inner, s0, s1 = sizes[1], strides[0], strides[1]
        prev = positions[lo] - start
        row, col = prev // inner, prev % inner
        for k in range(lo, hi):
            i = positions[k] - start
            col += i - prev
            prev = i
            if col >= inner:
                row += col // inner
                col %= inner
            out[row * s0 + col * s1] = values[k]
        return
    for k in range(lo, hi):
        i = positions[k] - start
        off = 0
        for d in range(nd - 1, 0, -1):
            off += (i % sizes[d]) * strides[d]
            i //= sizes[d]
        out[off + i * strides[0]] = values[k]
