"""Host kernels of the delta codec (``megarl.hybrid.delta``): the compare and the gaps coding as
single passes over a message, compiled by numba where it is installed (vLLM's CPU build brings it;
``pip install numba`` elsewhere). Without numba, ``AVAILABLE`` is False and the codec runs its
NumPy passes (several whole-message passes each); device tensors never come here. numba itself is
imported on the first delta encoded or applied on the host (:func:`kernels`), not with megarl: vLLM
0.32's workers fail to start in a process that has imported numba (its kernel dispatcher trips over
llvmlite's objects), and the engines start before the first sync.

The wire format is the codec's: for each changed element, ``gap // 255`` escape bytes (255) and
one byte ``gap % 255``, then the changed values in order. The arrays are integer views of the
tensors (bits, not values, decide).
"""

from __future__ import annotations

import importlib.util

AVAILABLE = importlib.util.find_spec("numba") is not None


def kernels():
    """The compiled passes (``megarl.hybrid.delta_kernels``: numba compiles them, or loads them
    from its cache, on first use)."""
    from megarl.hybrid import delta_kernels

    return delta_kernels
