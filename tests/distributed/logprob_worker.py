"""Worker for test_vocab_parallel.py: vocab-parallel log-probs/entropy and their gradients at
tp = world size against full-vocabulary log_softmax on every rank. Prints RESULT on rank 0."""

import json

import torch
import torch.distributed as dist

from megarl.engines.vocab_parallel import log_prob_and_entropy
from megarl.runtime import init_distributed, shutdown

if __name__ == "__main__":
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    vocab, padded = 250, 256  # the last rank's slice ends in 6 padding columns
    full = torch.randn(3, 7, padded, generator=gen, dtype=torch.float64).float() * 3
    full[..., vocab:] = 50.0  # padding logits must not leak into the softmax
    target = torch.randint(0, vocab, (3, 7), generator=gen)
    w_logp, w_ent = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    temperature = 0.7

    ref_logits = full.clone().requires_grad_()
    log_probs = torch.log_softmax(ref_logits[..., :vocab] / temperature, dim=-1)
    ref_logp = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_probs.exp() * log_probs).sum(-1)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()

    v_local = padded // world
    mine = full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    logp, ent = log_prob_and_entropy(mine, target, vocab_size=vocab, temperature=temperature,
                                     group=dist.group.WORLD if world > 1 else None)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    ref_grad = ref_logits.grad[..., rank * v_local:(rank + 1) * v_local]
    diffs = torch.tensor([(logp - ref_logp).abs().max().item(), (ent - ref_ent).abs().max().item(),
                          (mine.grad - ref_grad).abs().max().item()])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "logp": diffs[0].item(), "entropy": diffs[1].item(),
                                      "grad": diffs[2].item()}), flush=True)
    shutdown()  # gloo's threads torn down before interpreter exit (else an occasional abort at exit)
