"""The one owner of parallel layouts: sizes and rank arithmetic (pure), and their process groups.

A :class:`Layout` is (tp, pp, dp, ep, etp, cp, vpp) in Megatron's rank order ``tp-cp-ep-dp-pp``
(tp fastest). :meth:`Layout.validate` refuses impossible layouts before any process group exists.
:func:`build_groups` turns a layout into a :class:`ParallelGroups` object that code receives
explicitly; megarl keeps no module-level groups of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from megarl.runtime.distributed import collective_timeout


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message says which sizes to change."""


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# For each process-group kind, the coordinates its members share.
GROUP_KINDS: Dict[str, tuple] = {
    "tp": ("cp", "dp", "pp"), "pp": ("tp", "cp", "dp"), "dp": ("tp", "cp", "pp"),
    "cp": ("tp", "dp", "pp"), "dp_cp": ("tp", "pp"), "tp_cp": ("dp", "pp"), "tp_dp_cp": ("pp",),
    "mp": ("cp", "dp"), "ep": ("etp", "edp", "pp"), "expt_tp": ("ep", "edp", "pp"),
    "expt_dp": ("etp", "ep", "pp"), "tp_ep": ("edp", "pp"), "tp_ep_pp": ("edp",),
}

SINGLE_AXIS_KINDS = ("tp", "pp", "dp", "cp", "ep", "expt_tp", "expt_dp")


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of one model role."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # null = tp, as in Megatron
    cp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = True

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "Layout":
        """From a :class:`megarl.config.ParallelConfig`; ``dp=0`` takes the rest of the world."""
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(cfg, name) < 1:
                raise LayoutError(f"{name}={getattr(cfg, name)} must be a positive integer")
        model_parallel = cfg.tp * cfg.pp * cfg.cp
        dp = cfg.dp
        if dp == 0:
            if world_size % model_parallel:
                raise LayoutError(
                    f"world size {world_size} is not divisible by tp*pp*cp = "
                    f"{cfg.tp}*{cfg.pp}*{cfg.cp} = {model_parallel}; choose sizes whose product "
                    f"divides {world_size}"
                )
            dp = world_size // model_parallel
        layout = cls(cfg.tp, cfg.pp, dp, cfg.ep, cfg.etp, cfg.cp, cfg.vpp, cfg.sequence_parallel)
        layout.validate(world_size)
        return layout

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of expert weights: (tp*cp*dp) / (etp*ep)."""
        return (self.tp * self.cp * self.dp) // (self.etp * self.ep)

    def validate(self, world_size: Optional[int] = None) -> None:
        """Raise :class:`LayoutError` naming the sizes if this layout cannot exist."""
        for name in ("tp", "pp", "dp", "ep", "etp", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be a positive integer")
        if world_size is not None and self.world_size != world_size:
            model_parallel = self.tp * self.cp * self.pp
            hint = (f"set dp={world_size // model_parallel}" if world_size % model_parallel == 0 else
                    f"tp*cp*pp = {model_parallel} must divide {world_size}")
            raise LayoutError(
                f"tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world_size} "
                f"does not match the world size {world_size}; {hint}")
        dense = self.tp * self.cp * self.dp
        if dense % (self.etp * self.ep):
            fits = [e for e in _divisors(dense) if (dense // e) % self.etp == 0]
            raise LayoutError(
                f"etp*ep = {self.etp}*{self.ep} = {self.etp * self.ep} must divide tp*cp*dp = {dense}; "
                f"with etp={self.etp}, ep can be one of {fits} (or lower etp: expert weights need "
                f"not be split like the dense ones)")
        if self.ep == 1 and self.etp != self.tp:
            # Megatron treats experts as dense weights when ep == 1; their gradients are then
            # reduced over dp only, which is wrong when tp ranks hold different tokens.
            raise LayoutError(
                f"etp={self.etp} differs from tp={self.tp} with ep=1; set etp={self.tp} "
                f"(or ep > 1)")
        if self.vpp is not None:
            if self.vpp < 1:
                raise LayoutError(f"vpp={self.vpp} must be null or a positive integer")
            if self.vpp > 1 and self.pp == 1:
                raise LayoutError(f"vpp={self.vpp} needs pp > 1 (virtual stages interleave pipeline ranks)")

    def validate_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int,
                       ffn_hidden_size: int, padded_vocab_size: int, num_experts: Optional[int] = None,
                       moe_ffn_hidden_size: Optional[int] = None, training: bool = True) -> None:
        """Raise :class:`LayoutError` if the model cannot be split this way, saying what to change.
        ``training=False``: a model that only runs forward in eval mode (the native rollout's)."""
        def need(value: int, by: int, what: str, knob: str) -> None:
            if value % by:
                ok = [k for k in _divisors(value)]
                raise LayoutError(
                    f"{what} = {value} is not divisible by {knob} = {by}; "
                    f"choose {knob.split('*')[0]} so that it divides {value} (divisors: {ok})"
                )

        need(num_attention_heads, self.tp, "num_attention_heads", "tp")
        need(num_query_groups, self.tp, "num_query_groups (num_key_value_heads)", "tp")
        need(ffn_hidden_size, self.tp, "ffn_hidden_size (intermediate_size)", "tp")
        need(padded_vocab_size, self.tp, "padded vocab size", "tp")
        stages = self.pp * (self.vpp or 1)
        need(num_layers, stages, "num_layers", "pp*vpp" if self.vpp else "pp")
        if num_experts:
            need(num_experts, self.ep, "num_experts", "ep")
            if moe_ffn_hidden_size:
                need(moe_ffn_hidden_size, self.etp, "moe_ffn_hidden_size", "etp")
            # Megatron refuses to train MoE at tp > 1 without sequence parallelism; in eval mode
            # every tp rank routes all tokens and the dispatchers' reduce-scatter sums the partial
            # expert outputs back, so the generation model (one-token steps, no SP) may.
            if training and self.tp > 1 and not self.sequence_parallel:
                raise LayoutError("MoE with tp > 1 needs sequence_parallel=true")
        elif self.ep > 1:
            raise LayoutError(f"ep={self.ep} is set but the model has no experts; use ep=1")

    def megatron_sizes(self) -> Dict[str, Optional[int]]:
        """The sizes under Megatron's names (``initialize_model_parallel``, ``TransformerConfig``)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        }

    def coords(self, rank: int) -> Dict[str, int]:
        """Megatron coordinates of a global rank: order tp-cp-dp-pp for dense weights,
        etp-ep-edp-pp for expert weights (tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size}")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        inner = rank % (self.tp * self.cp * self.dp)
        return {
            "tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank,
            "etp": inner % self.etp,
            "ep": (inner // self.etp) % self.ep,
            "edp": inner // (self.etp * self.ep),
        }

    def group_ranks(self, kind: str) -> List[List[int]]:
        """The rank lists of every process group of ``kind`` (a :data:`GROUP_KINDS` name; Megatron's
        ``ProcessGroupCollection`` field names), each in rank order."""
        if kind in ("embd", "pos_embd"):
            stages = self.group_ranks("pp")
            return [[g[0]] if kind == "pos_embd" else sorted({g[0], g[-1]}) for g in stages]
        shared = GROUP_KINDS[kind]
        groups: Dict[tuple, List[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault(tuple(c[k] for k in shared), []).append(rank)
        return list(groups.values())

    def __str__(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("ep", "cp") if getattr(self, k) > 1]
        if self.etp != self.tp:
            parts.append(f"etp={self.etp}")
        if self.vpp:
            parts.append(f"vpp={self.vpp}")
        return "(" + ", ".join(parts) + ")"


@dataclass
class ParallelGroups:
    """The process groups of one layout on this rank, passed to whatever needs them.

    ``pg`` is Megatron's :class:`ProcessGroupCollection` (tp, pp, dp, dp_cp, ep, expt_tp,
    expt_dp, embd, ...); the ranks below are this process's coordinates in the layout.
    """

    layout: Layout
    pg: object  # megatron.core.process_groups_config.ProcessGroupCollection
    rank: int
    megatron_registry: bool = True  # these are the groups in Megatron's parallel_state

    @property
    def tp_rank(self) -> int:
        return self.pg.tp.rank()

    @property
    def pp_rank(self) -> int:
        return self.pg.pp.rank()

    @property
    def dp_rank(self) -> int:
        return self.pg.dp.rank()

    @property
    def ep_rank(self) -> int:
        return self.pg.ep.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def destroy(self) -> None:
        """Release the groups (Megatron's registry included) so another layout can be built."""
        from megatron.core import parallel_state

        if self.megatron_registry:
            parallel_state.destroy_model_parallel()
            return
        seen = set()
        for name in GROUP_KINDS.keys() | {"embd", "pos_embd"}:
            group = getattr(self.pg, name, None)
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                torch.distributed.destroy_process_group(group)


def build_groups(layout: Layout) -> ParallelGroups:
    """Create the process groups of ``layout`` over the initialised world.

    The layout is validated against the world size first, so an impossible layout fails before
    any group exists. megatron-core keeps a registry of the groups of its primary layout (its
    optimizer and MoE internals read it); megarl code only uses the returned object.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not torch.distributed.is_initialized():
        raise RuntimeError("call megarl.runtime.init_distributed() before build_groups()")
    layout.validate(torch.distributed.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    minutes = math.ceil(collective_timeout().total_seconds() / 60)  # the default group's timeout
    parallel_state.initialize_model_parallel(**layout.megatron_sizes(), order="tp-cp-ep-dp-pp",
                                             distributed_timeout_minutes=minutes)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelGroups(layout=layout, pg=pg, rank=torch.distributed.get_rank())


def build_placed_groups(layout: Layout, rank_at: Sequence[int]) -> ParallelGroups:
    """Process groups of ``layout`` when layout position ``v`` is global rank ``rank_at[v]``
    (a second layout beside Megatron's primary one, e.g. the generation layout of the hybrid
    engine). Collective: every rank calls it with the same arguments. Megatron's registry is
    left alone; code uses the returned groups.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = torch.distributed.get_world_size()
    layout.validate(world)
    if sorted(rank_at) != list(range(world)):
        raise LayoutError(f"rank_at must be a permutation of the {world} ranks")
    me = torch.distributed.get_rank()
    groups = {}
    for kind in list(GROUP_KINDS) + ["embd", "pos_embd"]:
        lists = [[rank_at[v] for v in g] for g in layout.group_ranks(kind)]
        for g in lists:
            # A process group numbers its members in global rank order; Megatron reads a
            # coordinate (tp rank, ep rank, ...) from that number, so the two must agree for
            # single-axis groups (joint groups such as tp_dp_cp only gather and reduce).
            if kind in SINGLE_AXIS_KINDS and g != sorted(g):
                raise LayoutError(f"{kind} group {g} of layout {layout} is not in global rank order")
        mine, _ = torch.distributed.new_subgroups_by_enumeration(lists)
        groups[kind] = mine
    groups["hcp"] = [groups["cp"]]
    groups["intra_dp_cp"] = groups["dp_cp"]
    groups["intra_expt_dp"] = groups["expt_dp"]
    groups["intra_dist_opt"] = groups["dp_cp"]
    pg = ProcessGroupCollection(**groups)
    return ParallelGroups(layout=layout, pg=pg, rank=me, megatron_registry=False)
