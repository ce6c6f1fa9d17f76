"""The built-in task: reverse the digits (``3141=`` → ``1413``), in the digit tokenizer's vocabulary.

Its RL prompts (:func:`reverse_digits_records`), the supervised warm start's demonstrations
(:func:`reverse_digits_conversations` for ``megarl sft``, :func:`reverse_digits_batch` for
``megarl train-lm``) and its verifier (:func:`reverse_digits_reward`, ``algorithm.reward_fn=reverse_digits``).
"""

from __future__ import annotations

import random
import re
from typing import Dict, List

from megarl.data.datasets import PromptRecord
from megarl.data.tokenizer import DigitTokenizer

_DIGITS = DigitTokenizer()
# The ids of the built-in tokenizer, so a model trained here reads the RL prompts unchanged.
BOS, EOS, SEP, DIGIT0 = _DIGITS.bos_token_id, _DIGITS.eos_token_id, _DIGITS.ids["="], _DIGITS.ids["0"]


def reverse_digits_records(count: int, num_digits: int, seed: int) -> List[PromptRecord]:
    """The built-in task: "3 1 4 =" → answer "413" (the digits reversed)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        out.append(PromptRecord(digits + "=", digits[::-1], f"reverse_digits:{i}"))
    return out




def reverse_digits_conversations(count: int, num_digits: int, seed: int,
                                 label_noise: float = 0.0) -> List[Dict[str, List[Dict[str, str]]]]:
    """``count`` chat rows ``{"messages": [user: "d1..dn=", assistant: the digits reversed]}``,
    each answer digit replaced by a random one with probability ``label_noise``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        answer = "".join(rng.choice("0123456789") if rng.random() < label_noise else d for d in digits[::-1])
        rows.append({"messages": [{"role": "user", "content": digits + "="}, {"role": "assistant", "content": answer}]})
    return rows


def reverse_digits_batch(step: int, batch_size: int, num_digits: int, seed: int,
                         label_noise: float = 0.0) -> Dict[str, "torch.Tensor"]:
    """``BOS d1..dn = dn..d1 EOS``: the built-in RL task's prompt (``d1..dn=`` with BOS, as
    ``DigitTokenizer.prompt_ids`` encodes it) followed by its response; the loss covers only the
    response (the reversed digits and EOS). ``label_noise``: each response digit is replaced by
    a uniformly random digit with this probability (noisy demonstrations).

    Returns next-token tensors [batch, 2n+2]: tokens, labels, loss_mask, position_ids. The same
    (step, seed) gives the same batch on every rank, so ranks agree without communication.
    """
    import torch  # here, not at the top: a reward worker imports this file for the verifier, without torch

    gen = torch.Generator().manual_seed(seed * 100003 + step)
    digits = torch.randint(0, 10, (batch_size, num_digits), generator=gen) + DIGIT0
    answer = digits.flip(1)
    if label_noise > 0:
        noisy = torch.rand(answer.shape, generator=gen) < label_noise
        answer = torch.where(noisy, torch.randint(0, 10, answer.shape, generator=gen) + DIGIT0, answer)
    full = torch.cat([torch.full((batch_size, 1), BOS), digits, torch.full((batch_size, 1), SEP),
                      answer, torch.full((batch_size, 1), EOS)], dim=1)  # [b, 2n+3]
    loss_mask = torch.zeros(batch_size, full.shape[1] - 1)
    loss_mask[:, num_digits + 1:] = 1.0  # labels at these positions are the reversed digits and EOS
    seq = full.shape[1] - 1
    return {"tokens": full[:, :-1].contiguous(), "labels": full[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": torch.arange(seq).expand(batch_size, -1).contiguous()}


def reverse_digits_reward(response: str, answer) -> float:
    """Partial credit: the fraction of positions where the response has the reversed digit,
    over max(len(answer), len(response)) so that extra digits cost too."""
    expected = str(answer)
    got = re.sub(r"\D", "", response)
    if not got:
        return 0.0
    hits = sum(a == b for a, b in zip(got, expected))
    return hits / max(len(expected), len(got))
