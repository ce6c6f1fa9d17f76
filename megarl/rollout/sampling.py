"""Token selection from next-token logits: temperature, top-k, top-p, greedy, for the whole batch
in one call, each row drawing from its own counter-based stream (row key, token counter), so
that draws do not depend on batching, on the layout or on which replica runs them."""

from __future__ import annotations

from typing import Tuple, Union

import torch

from megarl.rollout.types import SamplingParams

_M32 = 0xFFFF_FFFF
# lowbias32 (C. Wellons, "Hash function prospector"): xorshift-multiply rounds on 32-bit words.
_MIX = (16, 0x7FEB352D, 15, 0x846CA68B, 16)
_LANES = (0x9E3779B9, 0x7F4A7C15)  # two independent chains -> 64 random bits per draw


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside top-k / the top-p nucleus set to -inf. logits: [n, vocab]."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) held in int64, by 16-bit halves of c so that no product
    leaves int64 (signed overflow is undefined in C++; these ops are exact on every device)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    s1, c1, s2, c2, s3 = _MIX
    x = _mul32(x ^ (x >> s1), c1)
    x = _mul32(x ^ (x >> s2), c2)
    return x ^ (x >> s3)


def random_bits(keys: torch.Tensor, counter: Union[int, torch.Tensor], lane: int) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) per row: a hash of (the row's 63-bit key, counter) on
    chain ``lane``. keys: [n] int64 >= 0; counter: an int or [n] int64 in [0, 2^32)."""
    x = torch.full_like(keys, _LANES[lane])
    for word in (keys >> 32, keys & _M32, counter):
        x = _mix32(x ^ word)
    return x


def uniforms(keys: torch.Tensor, counter: Union[int, torch.Tensor]) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64 with 53 random bits, from (key, counter) alone."""
    high = random_bits(keys, counter, 0) >> 11  # 21 bits
    low = random_bits(keys, counter, 1)  # 32 bits
    return (high * (1 << 32) + low).double() * 2.0 ** -53


def sample(logits: torch.Tensor, sampling: SamplingParams, keys: torch.Tensor,
           counter: Union[int, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n], log-probs [n]) from logits [n, vocab] (real vocabulary only), one call for
    the batch. Row i draws with ``uniforms(keys, counter)[i]`` by inversion of the cumulative
    distribution of softmax(filtered logits / T), summed in float64, so a token's chance is its
    probability to float64 rounding (tokens filtered out have width 0 and are never drawn).
    Inversion needs one uniform per row; Gumbel-max would need one per vocabulary entry, 10x the
    time of the whole sampler on CPU (measured in benchmarks/rollout_probes.py).

    Log-probs are of the chosen tokens under softmax(logits / T) over the whole vocabulary, the
    distribution the trainer computes, whatever top-k/top-p truncation chose among."""
    logits = logits.float()
    scaled = logits / sampling.logprob_temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
        cdf = probs.double().cumsum(dim=-1)  # [n, vocab]
        target = uniforms(keys, counter).unsqueeze(-1) * cdf[:, -1:]  # < the total: u < 1
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def row_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit key of one sample's stream; it depends on the sample alone, never on the batch.
    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED."""
    return hash((seed, prompt_index, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF


def row_keys(keys, device=None) -> torch.Tensor:
    """The rows' keys as an int64 tensor [n] on the sampling device."""
    return torch.tensor(list(keys), dtype=torch.int64, device=device)
