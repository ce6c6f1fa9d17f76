"""Reductions over the valid tokens of ``[batch, response_len]`` tensors.

Shared by the advantage estimators (whitening) and the losses (metrics).
"""

from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import Tensor

Number = Union[float, Tensor]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 when there are none. Masked positions are
    selected away, not multiplied by 0, so an inf or NaN there cannot reach the result."""
    return select_valid(x, mask).sum() / mask.to(x.dtype).sum().clamp_min(1)


def select_valid(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is nonzero, 0 elsewhere. Unlike ``x * mask`` (inf * 0 = NaN) a non-finite
    value at a masked position gives neither a non-finite result nor a non-finite gradient."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean_var(x: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Mean and population (biased) variance of ``x`` over valid positions.

    Population variance, E[x^2] - E[x]^2, so that a trainer can get the global value from
    all-reduced (count, sum, sum of squares) and pass it to :func:`whiten_with_stats`.
    """
    mean = masked_mean(x, mask)
    return mean, masked_mean((x - mean) ** 2, mask)


def whiten_with_stats(
    x: Tensor, mask: Tensor, mean: Number, var: Number, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` at valid positions, 0 elsewhere.

    With ``shift_mean=False`` only the scale changes: the mean is added back, as PPO's
    reward normalisation does (Ziegler et al. 2019).
    """
    whitened = (x - mean) * torch.rsqrt(torch.as_tensor(var, dtype=x.dtype, device=x.device) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with the mean and variance of its own valid positions.

    Local statistics: a batch split over data-parallel ranks whitens identically only if the
    trainer computes global statistics and calls :func:`whiten_with_stats` instead.
    """
    mean, var = masked_mean_var(x, mask)
    return whiten_with_stats(x, mask, mean, var, shift_mean, eps)
