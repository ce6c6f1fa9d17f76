"""Built-in synthetic tasks of ``megarl train-lm`` that need no tokenizer or dataset download."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megarl.agent.tasks import call_text, observation_text
from megarl.data.tokenizer import DigitTokenizer

_DIGITS = DigitTokenizer()
# The ids of the built-in tokenizer, so a model trained here reads the RL prompts unchanged.
BOS, EOS, SEP, DIGIT0 = _DIGITS.bos_token_id, _DIGITS.eos_token_id, _DIGITS.ids["="], _DIGITS.ids["0"]


def reverse_digits_batch(step: int, batch_size: int, num_digits: int, seed: int,
                         label_noise: float = 0.0) -> Dict[str, torch.Tensor]:
    """``BOS d1..dn = dn..d1 EOS``: the built-in RL task's prompt (``d1..dn=`` with BOS, as
    ``DigitTokenizer.prompt_ids`` encodes it) followed by its response; the loss covers only the
    response (the reversed digits and EOS). ``label_noise``: each response digit is replaced by
    a uniformly random digit with this probability (noisy demonstrations).

    Returns next-token tensors [batch, 2n+2]: tokens, labels, loss_mask, position_ids. The same
    (step, seed) gives the same batch on every rank, so ranks agree without communication.
    """
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


def calculator_sequence_length(num_digits: int) -> int:
    """Input tokens of a calculator demonstration that calls the tool (the longest kind)."""
    # BOS a*b= (2n+3), (a*b) EOS (2n+4), |product| (2n+2), product EOS (2n+1); minus the last label
    return 8 * num_digits + 9


def calculator_batch(step: int, batch_size: int, num_digits: int, seed: int,
                     tool_call_rate: float) -> Dict[str, torch.Tensor]:
    """Demonstrations of the calculator task (megarl.agent.tasks:CalculatorTask), as the agent
    loop's transcripts: ``BOS a*b=`` then, with probability ``tool_call_rate``, the call
    ``(a*b) EOS``, the tool's observation ``|product|`` and the answer ``product EOS``; otherwise
    the answer ``product EOS`` at once. The loss covers the policy's tokens only (not the prompt,
    not the observation); rows are right-padded with <pad> under loss_mask 0.

    Returns next-token tensors [batch, 8n+9]: tokens, labels, loss_mask, position_ids; the same
    (step, seed) gives the same batch on every rank.
    """
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    operands = torch.randint(10 ** (num_digits - 1), 10 ** num_digits, (batch_size, 2), generator=gen)
    calls = torch.rand(batch_size, generator=gen) < tool_call_rate
    full_length = calculator_sequence_length(num_digits) + 1
    full = torch.full((batch_size, full_length), _DIGITS.pad_token_id)
    policy = torch.zeros(batch_size, full_length)  # 1 where the token is the policy's (its label is trained)
    for row, ((a, b), call) in enumerate(zip(operands.tolist(), calls.tolist())):
        expression, product = f"{a}*{b}", str(a * b)
        segments: List[Tuple[List[int], bool]] = [([BOS] + _DIGITS.encode(expression + "="), False)]
        if call:
            segments += [(_DIGITS.encode(call_text(expression)) + [EOS], True),
                         (_DIGITS.encode(observation_text(product)), False)]
        segments.append((_DIGITS.encode(product) + [EOS], True))
        at = 0
        for ids, is_policy in segments:
            full[row, at:at + len(ids)] = torch.tensor(ids)
            policy[row, at:at + len(ids)] = float(is_policy)
            at += len(ids)
    seq = full_length - 1
    return {"tokens": full[:, :-1].contiguous(), "labels": full[:, 1:].contiguous(),
            "loss_mask": policy[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).expand(batch_size, -1).contiguous()}
