"""Built-in synthetic tasks that need no tokenizer or dataset download."""

from __future__ import annotations

from typing import Dict

import torch

BOS, SEP, DIGIT0 = 1, 3, 4  # token ids; digits are DIGIT0..DIGIT0+9


def reverse_digits_batch(step: int, batch_size: int, num_digits: int, seed: int) -> Dict[str, torch.Tensor]:
    """``BOS d1..dn SEP dn..d1``: the loss covers only the reversed half.

    Returns next-token tensors [batch, 2n+1]: tokens, labels, loss_mask, position_ids. The same
    (step, seed) gives the same batch on every rank, so ranks agree without communication.
    """
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    digits = torch.randint(0, 10, (batch_size, num_digits), generator=gen) + DIGIT0
    full = torch.cat([torch.full((batch_size, 1), BOS), digits, torch.full((batch_size, 1), SEP),
                      digits.flip(1)], dim=1)  # [b, 2n+2]
    loss_mask = torch.zeros(batch_size, full.shape[1] - 1)
    loss_mask[:, num_digits + 1:] = 1.0  # labels at these positions are the reversed digits
    seq = full.shape[1] - 1
    return {"tokens": full[:, :-1].contiguous(), "labels": full[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": torch.arange(seq).expand(batch_size, -1).contiguous()}
