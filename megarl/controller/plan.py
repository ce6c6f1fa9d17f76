"""What a run would start, printed without starting it: ``megarl layout`` (the actor layout's
ranks) and ``megarl train --dry-run`` (nodes, ranks, the actor and rollout layouts, micro-DP
groups or split placement's transfers)."""

from __future__ import annotations

from typing import List

from megarl.config.schema import Loop, ParamsDtype, Placement
from megarl.hybrid import regroup
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout
from megarl.rollout.backends import rollout_backend, rollout_dtype, transfer_plan


def layout_lines(layout: Layout) -> List[str]:
    """``megarl layout``: every rank's coordinates in ``layout``."""
    lines = [f"actor layout {layout} over {layout.world_size} ranks (Megatron order tp-cp-ep-dp-pp)"]
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        lines.append(f"rank {rank:4d}: " + " ".join(f"{k}={v}" for k, v in coords.items()))
    return lines


def plan(cfg, layout) -> str:
    """What a run would start: nodes, ranks, the actor and rollout layouts, micro-DP groups."""
    args = megatron_args_from_hf(cfg.model.hf_config)
    r = cfg.parallel.rollout
    if cfg.trainer.placement == Placement.split:
        return split_plan(cfg, layout, args)
    rg = regroup(layout, r.tp, r.pp, r.ep, args.num_experts or 0)
    lines = [f"nodes {cfg.trainer.nnodes} x {cfg.trainer.nproc_per_node} ranks = world {layout.world_size}; "
             f"ray {cfg.trainer.ray_address or 'private, 127.0.0.1'}",
             f"actor layout {layout}; rollout layout {rg.gen} ({r.engine}); micro-DP size {rg.micro_dp}",
             f"algorithm {cfg.algorithm.name}; {cfg.data.prompts_per_step} prompts x "
             f"{cfg.algorithm.samples_per_prompt} samples per step; loop {cfg.trainer.loop}"]
    lines += rollout_backend(r.engine).plan_lines(cfg, rg.gen, cfg.trainer.placement)
    rm = cfg.reward_model
    if rm.generative:  # the judge: its own engine on these ranks, in the rollout's layout
        from megarl.rewards.judge import judge_hf_config

        judge = megatron_args_from_hf(judge_hf_config(rm))
        gen = regroup(layout, r.tp, r.pp, r.ep if judge.num_experts else 1, judge.num_experts or 0).gen
        lines.append(f"judge {rm.path} ({judge.model_type}) on every rank, layout {gen} "
                     f"({rm.engine or r.engine}), asleep between calls; {rm.batch_size} judgements a call, "
                     f"{rm.max_new_tokens} tokens each, {rm.timeout_s:g} s a step at most")
    for rank in range(layout.world_size):
        c, g = layout.coords(rank), rg.gen_coords(rank)
        lines.append(f"rank {rank:4d} node {rank // cfg.trainer.nproc_per_node}: actor tp={c['tp']} pp={c['pp']} "
                     f"dp={c['dp']} ep={c['ep']} | rollout tp={g['tp']} pp={g['pp']} dp={g['dp']} | "
                     f"micro-DP group {list(rg.micro_dp_group(rank))}")
    return "\n".join(lines)


def split_plan(cfg, layout, args) -> str:
    """The plan of split placement: the trainer's ranks, the rollout's, and what each rollout rank
    receives per sync (its generation shard) from which training ranks."""
    r, t = cfg.parallel.rollout, cfg.trainer
    tp = transfer_plan(cfg, args)
    backend = rollout_backend(r.engine)
    itemsize = 2 if (rollout_dtype(r) or cfg.model.params_dtype) == ParamsDtype.bfloat16 else 4
    staleness = {Loop.sync: "0", Loop.one_step_off: str(t.max_staleness or 1), Loop.async_: str(t.max_staleness or 1)}[t.loop]
    lines = [f"placement split: trainer {layout.world_size} ranks (actor layout {layout}); rollout {r.nproc} ranks "
             f"(layout {tp.gen}, {r.engine}); ray {t.ray_address or 'private, 127.0.0.1'}",
             f"algorithm {cfg.algorithm.name}; {cfg.data.prompts_per_step} prompts x {cfg.algorithm.samples_per_prompt} "
             f"samples per step; loop {t.loop}"
             + (f", samples streamed ({r.max_inflight or cfg.data.prompts_per_step * cfg.algorithm.samples_per_prompt} "
                f"in flight, staleness policy {t.staleness_policy})" if t.loop == Loop.async_ else
                f", streaming up to {t.max_staleness} versions ahead" if t.max_staleness else "")
             + f" (staleness <= {staleness})",
             f"weight sync: {len(tp.buckets)} bucket(s) over the group spanning trainer ranks 0..{tp.offset - 1} and "
             f"rollout ranks {tp.offset}..{tp.world_size - 1}"
             + backend.weight_path()]
    lines += backend.plan_lines(cfg, tp.gen, t.placement)
    whole = backend.split_plan_lines(cfg, tp, layout, itemsize)
    if whole is not None:  # whole tensors by broadcast, not shards point to point
        return "\n".join(lines + whole)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        lines.append(f"trainer rank {rank:4d}: actor tp={c['tp']} pp={c['pp']} dp={c['dp']} ep={c['ep']} | sends "
                     f"{tp.sent(rank) * itemsize / 2**20:.2f} MiB per sync")
    for v in range(tp.gen.world_size):
        g = tp.gen.coords(v)
        sources = sorted({s.src for b in tp.buckets for s in b if s.dst == tp.offset + v})
        lines.append(f"rollout rank {v:4d} (group rank {tp.offset + v}): tp={g['tp']} dp={g['dp']} | receives "
                     f"{tp.received(v) * itemsize / 2**20:.2f} MiB = its generation shard "
                     f"({tp.shard_elems(v)} elements) from trainer ranks {sources}")
    return "\n".join(lines)
