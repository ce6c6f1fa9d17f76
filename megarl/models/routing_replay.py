"""MoE routing replay (R3): the rollout records each token's top-k experts per MoE layer, and the
trainer's routers select those experts again while their gating weights stay live.

Built on megatron-core's hook: ``TopKRouter.router_replay`` is asked for the top-k in
``topk_routing_with_score_function``. Megatron's own ``RouterReplay`` registers every router of the
process in one list (``global_router_replay_instances``); in colocated placement that list mixes
the actor's, the rollout's, the reference's and the critic's routers. So each model gets its own
:class:`RouterHandle` objects, found in that model's modules and addressed by MoE layer index.

Routing tensors are ``[rows, seq, moe_layers, topk]`` integers aligned with the trainer's
``tokens`` (the expert ids of the token fed at that position), -1 where there is no token.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from megarl.config.schema import Recompute


def moe_layer_index(config) -> Dict[int, int]:
    """Global layer number (1-based, as ``Router.layer_number``) -> MoE layer index (0-based),
    from ``moe_layer_freq`` as megatron's GPT layer specs read it."""
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    numbers = [i + 1 for i, moe in enumerate(pattern) if moe]
    return {number: index for index, number in enumerate(numbers)}


class RouterHandle:
    """One router's replay state, duck-typing megatron's ``RouterReplay.get_replay_topk``.

    ``record``: keep the live top-k indices of the last forward in ``recorded``. With a ``target``
    ([tokens, topk], megatron's sequence-first token order): ``replay`` selects the target's experts
    (pad tokens, -1, take experts 0..k-1) and ``count`` compares with it, over the target's tokens,
    the top-k sets the layer used (``mismatched``) and those its live scores choose
    (``live_mismatched``; the same without replay)."""

    def __init__(self, moe_index: int):
        self.moe_index = moe_index
        self.record = False
        self.replay = False
        self.count = False
        self.target: Optional[torch.Tensor] = None
        self.recorded: Optional[torch.Tensor] = None
        self.mismatched = 0  # (token, layer) top-k sets that differ from the target, while count
        self.live_mismatched = 0
        self.compared = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        live = None
        if self.target is None or not self.replay or self.count:
            # no_grad when only compared: the replayed selection below carries the gradient
            with torch.set_grad_enabled(torch.is_grad_enabled() and not (self.replay and self.target is not None)):
                live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.record:
            self.recorded = live[1].detach()
        if self.target is None:
            return live
        target = self.target.to(scores.device)  # [tokens, topk]
        valid = target[:, 0] >= 0
        if self.replay:
            # A pad token's output reaches no loss and, without expert capacity, no other token:
            # any distinct experts do.
            pad = torch.arange(topk, device=scores.device).expand_as(target)
            indices = torch.where(valid[:, None], target.long(), pad)
            # Gating weights from the live scores at the replayed experts: the router keeps its gradient.
            chosen = scores.gather(1, indices), indices
        else:
            chosen = live
        if self.count:
            wanted = target.sort(dim=-1).values
            self.mismatched += int((valid & (chosen[1].sort(dim=-1).values != wanted).any(dim=-1)).sum())
            self.live_mismatched += int((valid & (live[1].sort(dim=-1).values != wanted).any(dim=-1)).sum())
            self.compared += int(valid.sum())
        return chosen


def attach(chunks: Sequence[torch.nn.Module]) -> List[List[RouterHandle]]:
    """Give every MoE router of ``chunks`` (one model: its pipeline or virtual stages) its own
    handle; per chunk, the handles of the layers it holds."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for chunk in chunks:
        handles = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                index = moe_layer_index(module.config)[module.layer_number]
                module.router_replay = RouterHandle(index)
                handles.append(module.router_replay)
        out.append(handles)
    return out


def set_targets(handles: Sequence[RouterHandle], routing: torch.Tensor, sp_rank: int = 0, sp_size: int = 1) -> None:
    """Targets for one micro-batch: ``routing`` [n, s, moe_layers, topk] (or packed [1, T, ...]).
    The router sees tokens sequence-first, [s, n] flattened, and with sequence parallelism only
    this tensor-parallel rank's contiguous s/tp slice."""
    for handle in handles:
        target = routing[:, :, handle.moe_index].transpose(0, 1)  # [s, n, topk]
        if sp_size > 1:
            target = target.chunk(sp_size, dim=0)[sp_rank]
        handle.target = target.reshape(-1, target.shape[-1])


def clear(handles: Sequence[RouterHandle]) -> None:
    """Drop the targets (a pass's micro-batches); a record stays until the next forward."""
    for handle in handles:
        handle.target = None


def check_config(records_routing: bool, num_experts: int, recompute_granularity) -> None:
    """``algorithm.routing_replay=true``: the rollout backend records routing (``records_routing``),
    the model has experts, and no full recompute re-routes in the backward pass."""
    from megarl.config import ConfigError

    if not records_routing:
        raise ConfigError("algorithm.routing_replay=true needs the rollout's expert choices, which only the native "
                          "engine records; set parallel.rollout.engine=native or algorithm.routing_replay=false")
    if not num_experts:
        raise ConfigError("algorithm.routing_replay=true needs an MoE model; model.hf_config describes a dense "
                          "one (no experts); set algorithm.routing_replay=false")
    if recompute_granularity == Recompute.full:
        # full recompute re-routes in the backward pass, out of step with the micro-batch being replayed
        raise ConfigError("algorithm.routing_replay=true does not support model.recompute_granularity='full'; "
                          "use selective or no recompute")
