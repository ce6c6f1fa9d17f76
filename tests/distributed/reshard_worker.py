"""Worker for test_reshard.py (run under torchrun). Prints one ``RESULT {json}`` line on rank 0.

``reference WORK MODEL...``: one process builds each full model (tp=pp=ep=1), saves it as a
dist checkpoint, as plain tensors by name, and its logits on a fixed batch.
``reshard WORK CASE...``, a case being ``model@t,p,d,e[,vpp]>tg,pg,eg[:mode]``: load that
checkpoint in the training layout, reshard to the generation layout, and check on every rank:
the generation shard is bit-identical to slicing the full model; bytes received equal the plan;
extra memory stays within one bucket; once all weights but one are frozen, only that one moves. At p_g = 1 a generation model built on the generation groups gives the logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.dist_ckpt import load_model, save_model
from megarl.config import ModelConfig
from megarl.hybrid import ModelSpec, Resharder, regroup
from megarl.models import build_model
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout, build_groups, build_placed_groups
from megarl.runtime import init_distributed, set_seed

# name: (HF config, overrides); four KV heads so that tp = 4 is possible
MODELS = {"llama": ("tiny-llama", {"num_key_value_heads": 4}),
          "llama-tied": ("tiny-llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
          "qwen2": ("tiny-qwen2", {}), "qwen3-moe": ("tiny-qwen3-moe", {}),
          "mixtral": ("tiny-mixtral", {}), "deepseek": ("tiny-deepseek-v3", {}),
          # gated delta nets: in_proj [Q; K; V; Z; B; A] and conv1d [Q; K; V], blocks of unequal sizes
          "qwen3-next": ("tiny-qwen3-next", {})}
TOKENS = torch.tensor([[5, 17, 42, 7, 99, 3, 249, 64, 12, 8, 1, 77],
                       [9, 9, 120, 33, 2, 45, 6, 200, 31, 4, 15, 60]])
BUCKET_BYTES = 48 << 10  # small, so that tensors are cut and buckets are many


def model_config(work: Path, name: str) -> ModelConfig:
    base, overrides = MODELS[name]
    hf = json.loads(Path(f"configs/models/{base}.json").read_text()) | overrides
    path = work / f"{name}.json"
    if dist.get_rank() == 0 and not path.exists():
        path.write_text(json.dumps(hf))
    dist.barrier()
    return ModelConfig(hf_config=str(path))


def logits_of(model, groups) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        out = model.eval()(TOKENS, positions, None)  # [b, s, vocab/tp]
    if groups.layout.tp == 1:
        return out
    parts = [torch.empty_like(out) for _ in range(groups.layout.tp)]
    dist.all_gather(parts, out.contiguous(), group=groups.pg.tp)
    return torch.cat(parts, dim=-1)


def reference(work: Path, name: str) -> None:
    groups = build_groups(Layout())
    set_seed(7, groups)
    chunks = build_model(model_config(work, name), groups)
    save_model(chunks, work / f"{name}-ckpt")
    model = chunks[0]
    torch.save({k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())},
               work / f"{name}-full.pt")
    torch.save(logits_of(model, groups), work / f"{name}-logits.pt")
    groups.destroy()


def slice_full(full: torch.Tensor, spec, local) -> torch.Tensor:
    return torch.cat([full.narrow(spec.split_dim, p.start, p.stop - p.start) for p in local.pieces], spec.split_dim)


def needed(plan, rank: int) -> int:
    """Elements of the generation shard that ``rank`` does not hold already (computed from the
    two placements alone, independently of the planner's choice of senders)."""
    model, own = plan.model, {t.spec: t for t in plan.sources[rank]}
    total = 0
    for gen in plan.gen[rank]:
        spec = model.tensors[gen.spec]
        have = 0
        for p in gen.pieces:
            for q in own[gen.spec].pieces if gen.spec in own else ():
                have += max(0, min(p.stop, q.stop) - max(p.start, q.start))
        total += spec.slice_numel(sum(p.stop - p.start for p in gen.pieces) - have)
    return total


def reshard(work: Path, case: str) -> dict:
    name, rest = case.split("@")
    train_spec, rest = rest.split(">")
    gen_spec, mode = rest.split(":") if ":" in rest else (rest, "micro_dp")
    sizes = [int(x) for x in train_spec.split(",")]
    tp, pp, dp, ep = sizes[:4]
    vpp = (sizes[4] or None) if len(sizes) > 4 else None
    cp = sizes[5] if len(sizes) > 5 else 1  # context-parallel ranks: generation replicas
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else None, vpp=vpp, cp=cp)
    gen_tp, gen_pp, gen_ep = (int(x) for x in gen_spec.split(","))
    model_cfg = model_config(work, name)
    args = megatron_args_from_hf(model_cfg.hf_config)
    groups = build_groups(layout)
    set_seed(7, groups)
    chunks = build_model(model_cfg, groups, args, initialize=False)
    load_model(chunks, work / f"{name}-ckpt")

    model = ModelSpec.from_args(args)
    rg = regroup(layout, gen_tp, gen_pp, gen_ep, model.num_experts)
    resharder = Resharder.create(model, rg, chunks, bucket_bytes=BUCKET_BYTES, mode=mode)
    plan, rank = resharder.plan, dist.get_rank()
    full = torch.load(work / f"{name}-full.pt")
    out = resharder.sync()
    first = resharder.last

    def mismatches():
        bad = []
        for local in plan.gen[rank]:
            spec = model.tensors[local.spec]
            if not torch.equal(out[local.name], slice_full(full[spec.key], spec, local)):
                bad.append(local.name)
        return bad

    itemsize = 4
    record = {
        "rank": rank, "mismatched": mismatches(),
        "received": first.bytes_received, "planned_received": plan.received(rank) * itemsize,
        "sent": first.bytes_sent, "planned_sent": plan.sent(rank) * itemsize,
        "peak_extra": first.peak_extra_bytes, "bucket_bytes": BUCKET_BYTES,
        "gen_shard": model.local_numel(plan.gen[rank]) * itemsize,
        "train_shard": model.local_numel(plan.sources[rank]) * itemsize,
        "needed": needed(plan, rank) * itemsize,
        "micro_dp_group": list(rg.micro_dp_group(rank)),
        "dense_senders": sorted({s.src for b in plan.buckets for s in b
                                 if s.dst == rank and model.tensors[s.tensor].expert is None}),
    }
    # Freeze all but the final norm, then change it as an optimizer step would: only it moves.
    key = "decoder.final_layernorm.weight"
    for chunk in chunks:
        for param_name, param in chunk.named_parameters():
            param.requires_grad_(param_name == key)
    named = dict(chunks[-1].named_parameters())
    if key in named:
        named[key].data.add_(1.0)
    full[key] = full[key] + 1.0
    resharder.sync()
    record["second_sync_moved"] = resharder.last.tensors_moved
    record["second_sync_received"] = resharder.last.bytes_received
    record["second_mismatched"] = mismatches()
    if key in named:  # back to the reference weights, for the logits below
        named[key].data.sub_(1.0)
    resharder.sync()

    if gen_pp == 1:
        gen_groups = build_placed_groups(rg.gen, [rg.gen_rank.index(v) for v in range(layout.world_size)])
        gen_model = build_model(model_cfg, gen_groups, args, initialize=False)[0]
        tensors = dict(gen_model.named_parameters()) | dict(gen_model.named_buffers())
        for local in plan.gen[rank]:
            tensors[local.name].data.copy_(out[local.name])
        ref = torch.load(work / f"{name}-logits.pt")
        record["logits_max_abs_diff"] = (logits_of(gen_model, gen_groups) - ref).abs().max().item()
        record["logits_scale"] = ref.abs().max().item()
        gen_groups.destroy()
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    groups.destroy()
    split = sum(t.numel for t in model.tensors if t.dim is not None and t.expert is None)
    replicated = sum(t.numel for t in model.tensors if t.dim is None)
    return {"case": case, "ranks": records, "split_bytes": split * itemsize,
            "replicated_bytes": replicated * itemsize, "experts": model.num_experts}


if __name__ == "__main__":
    init_distributed()
    mode, work = sys.argv[1], Path(sys.argv[2])
    for arg in sys.argv[3:]:
        if mode == "reference":
            reference(work, arg)
        else:
            result = reshard(work, arg)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(result), flush=True)
