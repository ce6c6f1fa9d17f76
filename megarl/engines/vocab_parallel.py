"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary; the full softmax is
never gathered: ranks exchange one max, one normaliser and one target logit per token
(three all-reduces of [tokens] floats). Rows past the real vocabulary (TP padding) are
excluded, so the numbers equal ``log_softmax`` over the real vocabulary, as in transformers.
The backward pass is analytic: d logp / d z = onehot - p, d H / d z = -p (log p + H).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        # logits: [n, v_local] float32; target: [n] global token ids
        v_local = logits.shape[-1]
        real = min(max(vocab_size - vocab_start, 0), v_local)  # columns inside the real vocabulary
        z = logits[:, :real]
        z_max = z.max(dim=-1).values if real > 0 else logits.new_full(logits.shape[:1], float("-inf"))
        if group is not None:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - z_max.unsqueeze(-1)
        exp = shifted.exp()
        stats = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])  # [2, n]
        local = target - vocab_start
        inside = (local >= 0) & (local < real)
        picked = torch.where(inside, shifted.gather(-1, local.clamp(0, max(real - 1, 0)).unsqueeze(-1)).squeeze(-1)
                             if real > 0 else torch.zeros_like(z_max), torch.zeros_like(z_max))
        reduced = torch.cat([stats, picked.unsqueeze(0)])
        if group is not None:
            dist.all_reduce(reduced, group=group)
        sum_exp, exp_shift, picked = reduced
        log_z = sum_exp.log()
        logp = picked - log_z
        entropy = log_z - exp_shift / sum_exp
        probs = exp / sum_exp.unsqueeze(-1)  # [n, real]
        ctx.save_for_backward(probs, local, inside, entropy, log_z)
        ctx.shape = logits.shape
        # An output the loss does not use (the entropy at entropy_coef 0) gets None, not zeros,
        # so the backward skips its [n, v_local] term.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        probs, local, inside, entropy, log_z = ctx.saved_tensors
        real = probs.shape[-1]
        grad = torch.zeros(ctx.shape, dtype=probs.dtype, device=probs.device)
        g = grad[:, :real]  # a view: the real vocabulary columns
        if grad_logp is not None:
            g -= probs * grad_logp.unsqueeze(-1)
        if grad_entropy is not None:
            log_p = torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))
            g -= probs * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        if grad_logp is not None:
            rows = torch.nonzero(inside).squeeze(-1)
            g[rows, local[rows]] += grad_logp[rows]
        return grad, None, None, None, None


def log_prob_and_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_size: int,
                         group: Optional[dist.ProcessGroup] = None,
                         temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` and entropy of the next-token distribution, per token.

    ``logits``: [..., vocab_padded / tp] this rank's vocabulary slice (rank r holds columns
    r*v_local ... (r+1)*v_local); ``target``: [...] token ids; ``vocab_size``: the real
    (unpadded) vocabulary; ``group``: the tensor-parallel group (None for one rank).
    Returns two float32 tensors shaped like ``target``. Differentiable in ``logits``.
    """
    rank = dist.get_rank(group) if group is not None else 0
    v_local = logits.shape[-1]
    flat = (logits.float() / temperature).reshape(-1, v_local)
    logp, entropy = _LogProbEntropy.apply(flat, target.reshape(-1), rank * v_local, vocab_size, group)
    return logp.view(target.shape), entropy.view(target.shape)
