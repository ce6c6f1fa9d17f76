"""The compiled host passes of the delta codec (numba), imported on first use through
``megarl.hybrid.delta_host.kernels()`` so that a process that never encodes a delta never imports
numba. See ``delta_host`` for the wire format they write.
"""

from __future__ import annotations

import numba
import numpy as np

ESCAPE = 255
_jit = numba.njit(cache=True, nogil=True)


@_jit
def count(new, last):  # pragma: no cover - compiled
    """Changed elements of ``new`` against ``last`` (a loop without branches: vectorised)."""
    nnz = 0
    for i in range(new.size):
        nnz += new[i] != last[i]
    return nnz


@_jit
def changed(new, last, positions, values):  # pragma: no cover - compiled
    """The positions and values of the changed elements, into ``positions`` and ``values`` (one
    element longer than the changes: each element is written, the index moves on a change,
    so the loop never branches on the data)."""
    k = 0
    for i in range(new.size):
        v = new[i]
        values[k] = v
        positions[k] = i
        k += v != last[i]
    return k


@_jit
def escapes(positions, nnz):  # pragma: no cover - compiled
    """Escape bytes the gaps of ``positions[:nnz]`` need."""
    out, prev = 0, -1
    for k in range(nnz):
        out += (positions[k] - prev - 1) // ESCAPE
        prev = positions[k]
    return out


@_jit
def write_gaps(positions, nnz, prefix):  # pragma: no cover - compiled
    """The gap bytes of ``positions[:nnz]`` into ``prefix`` (``nnz`` + escapes bytes)."""
    j, prev = 0, -1
    for k in range(nnz):
        gap = positions[k] - prev - 1
        while gap >= ESCAPE:
            prefix[j] = ESCAPE
            j += 1
            gap -= ESCAPE
        prefix[j] = gap
        j += 1
        prev = positions[k]


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
