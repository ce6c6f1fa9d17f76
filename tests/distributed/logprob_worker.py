"""Worker for test_vocab_parallel.py. Prints RESULT lines on rank 0.

``vocab``: vocab-parallel log-probs/entropy and their gradients at tp = world size against
full-vocabulary log_softmax on every rank.
``cp`` (world > 1): SDPACoreAttention at cp = world size (Megatron's load-balanced chunks, K/V
all-gathered) against the same attention at cp = 1 on the whole sequence, in float64: outputs
and the gradients of q, k and v, padded (with and without an explicit mask) and packed, plain and
with a sliding window and learnable sinks (whose gradient, summed over the CP ranks as the
data-parallel reduction does, equals cp = 1's); and megarl's CP split against megatron-core's
``get_batch_on_this_cp_rank``.
"""

import json

import torch
import torch.distributed as dist

from megarl.engines.vocab_parallel import log_prob_and_entropy
from megarl.runtime import init_distributed, shutdown


def vocab_check(rank: int, world: int) -> dict:
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
    return {"check": "vocab", "world": world, "logp": diffs[0].item(), "entropy": diffs[1].item(),
            "grad": diffs[2].item()}


def cp_check(rank: int, cp: int) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megarl.models.sdpa_attention import SDPACoreAttention
    from megarl.parallel.context import split_for_rank

    group = dist.group.WORLD

    def attention(cp_size: int, **extra):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   kv_channels=16, attention_dropout=0.0, context_parallel_size=cp_size,
                                   use_cpu_initialization=True, **extra)
        return SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                                 pg_collection=ProcessGroupCollection(cp=group) if cp_size > 1 else None).double()

    gen = torch.Generator().manual_seed(1)
    # a window of 3 crosses the CP chunks (2 tokens each); sinks of either sign
    slide = dict(window_size=(2, 0), softmax_type="learnable")
    pairs = {"": (attention(1), attention(cp)), "_window_sinks": (attention(1, **slide), attention(cp, **slide))}
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) * 2
    with torch.no_grad():
        for attn in pairs["_window_sinks"]:
            attn.softmax_offset.copy_(sinks)
    diffs = {}

    def compare(name, shapes, lengths, dim_seq, **kwargs):
        """cp=1 on whole tensors vs cp on this rank's share; forward and q/k/v (and sink) gradients."""
        tensors = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
        grad_out = torch.randn(*shapes[0][:-2], shapes[0][-2] * shapes[0][-1], generator=gen, dtype=torch.float64)
        for suffix, (full_attn, cp_attn) in pairs.items():
            full_attn.zero_grad(), cp_attn.zero_grad()
            leaves = [t.clone().requires_grad_() for t in tensors]
            ref = full_attn(*leaves, kwargs.get("mask"), packed_seq_params=kwargs.get("params"))
            ref.backward(grad_out)
            mine = [split_for_rank(t, lengths, cp, rank, dim_seq).requires_grad_() for t in tensors]
            mask = kwargs.get("mask")
            local_mask = None if mask is None else split_for_rank(mask, lengths, cp, rank, 2)  # queries only
            out = cp_attn(*mine, local_mask, packed_seq_params=kwargs.get("params"))
            out.backward(split_for_rank(grad_out, lengths, cp, rank, dim_seq))
            worst = (out - split_for_rank(ref, lengths, cp, rank, dim_seq)).abs().max()
            for got, leaf in zip(mine, leaves):
                worst = max(worst, (got.grad - split_for_rank(leaf.grad, lengths, cp, rank, dim_seq)).abs().max())
            if suffix:
                summed = cp_attn.softmax_offset.grad.clone()
                dist.all_reduce(summed, group=group)
                worst = max(worst, (summed - full_attn.softmax_offset.grad).abs().max())
            diffs[name + suffix] = worst.item()

    seq, b = 4 * cp, 3
    sbhd = [(seq, b, 4, 16), (seq, b, 2, 16), (seq, b, 2, 16)]
    compare("padded", sbhd, [seq], 0)
    blocked = torch.rand(b, 1, seq, seq, generator=gen) < 0.3
    blocked[:, :, torch.arange(seq), torch.arange(seq)] = False  # every query sees itself
    compare("padded_mask", sbhd, [seq], 0, mask=blocked)
    lengths = [2 * cp, 6 * cp, 4 * cp]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    total = sum(lengths)
    compare("packed", [(total, 4, 16), (total, 2, 16), (total, 2, 16)], lengths, 0, params=params)

    x = torch.arange(2 * seq * 3).view(2, seq, 3)
    megatron = get_batch_on_this_cp_rank({"x": x.clone()}, cp_group=group)["x"]
    split_ok = float(torch.equal(megatron, split_for_rank(x, [seq], cp, rank)))
    worst = torch.tensor([max(diffs.values()), -split_ok])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"check": "cp", "world": cp, **diffs, "max_diff": worst[0].item(), "split_matches_megatron": -worst[1].item()}


if __name__ == "__main__":
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [vocab_check(rank, world)] + ([cp_check(rank, world)] if world > 1 else [])
    if rank == 0:
        for result in results:
            print("RESULT " + json.dumps(result), flush=True)
    shutdown()  # gloo's threads torn down before interpreter exit (else an occasional abort at exit)
