"""Host kernels of the delta codec (``megarl.hybrid.delta``): the compare, the encodings and the
scatter as single passes, compiled by numba where it is installed (vLLM's CPU build brings it;
``pip install numba`` elsewhere). Without numba, ``AVAILABLE`` is False and the codec runs its
NumPy passes (several whole-message passes each); device tensors never come here. numba itself is
imported on the first delta encoded or applied on the host (:func:`kernels`), not with megarl: vLLM
0.32's workers fail to start in a process that has imported numba (its kernel dispatcher trips over
llvmlite's objects), and the engines start before the first sync.

The wire format is the codec's (``megarl.hybrid.delta``); a test holds the compiled and NumPy
passes byte-equal. The arrays are integer views of the tensors (bits, not values, decide).
"""

from __future__ import annotations

import importlib.util
import sys

# the mask is written as uint64 words, whose bytes are the wire's bitmask on a little-endian host
AVAILABLE = importlib.util.find_spec("numba") is not None and sys.byteorder == "little"


def kernels():
    """The compiled passes (``megarl.hybrid.delta_kernels``: numba compiles them, or loads them
    from its cache, on first use)."""
    from megarl.hybrid import delta_kernels

    return delta_kernels
