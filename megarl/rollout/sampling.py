"""Token selection from next-token logits: temperature, top-k, top-p, greedy, with one random
stream per sample so that draws do not depend on batching or on which replica runs them."""

from __future__ import annotations

from typing import List, Tuple

import torch

from megarl.rollout.types import SamplingParams


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


def sample(logits: torch.Tensor, sampling: SamplingParams, generators: List[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n], log-probs [n]) from logits [n, vocab] (real vocabulary only).

    Log-probs are of the chosen tokens under softmax(logits / T) over the whole vocabulary, the
    distribution the trainer computes, whatever top-k/top-p truncation chose among."""
    logits = logits.float()
    scaled = logits / sampling.logprob_temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
        tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def generator_for(seed: int, prompt_index: int, sample_index: int, device=None) -> torch.Generator:
    """The random stream of one sample, on the device that samples (torch samples CUDA
    probabilities with CUDA generators only). The stream depends on the sample alone, never on
    the batch; a CUDA stream draws other numbers than the CPU stream of the same seed."""
    return torch.Generator(device=device or "cpu").manual_seed(
        hash((seed, prompt_index, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF)
