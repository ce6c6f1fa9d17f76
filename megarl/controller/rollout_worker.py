"""The SPMD worker of the rollout under split placement (``trainer.placement=split``): its own
ranks and ``torch.distributed`` world, the generation layout ``parallel.rollout`` as its only
Megatron layout, and weights received from the trainer's ranks over the process group that
spans both (the backend's transport, megarl.transports). Generation here runs while the trainer trains.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from megarl.protocol import declared_verbs
from megarl.roles.rollout import Rollout
from megarl.runtime import init_distributed, peak_rss_gb, progress, set_seed


class RolloutWorker:
    """One rank of the rollout's worker group."""

    def __init__(self, rank: int, world_size: int, config):
        self.rank, self.world_size, self.cfg = rank, world_size, config

    def rendezvous(self):
        from megarl.controller.group import rendezvous_address

        return rendezvous_address(local=self.cfg.trainer.nnodes == 1)

    def setup(self, master_addr: str, master_port: int) -> Dict:
        from megarl.rollout.backends import transfer_plan
        from megarl.models.hf_config import megatron_args_from_hf
        from megarl.rollout.backends import rollout_backend

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        cfg = self.cfg
        init_distributed(progress.collective_timeout_s(cfg.trainer.hang_timeout_s))
        args = megatron_args_from_hf(cfg.model.hf_config)
        plan = transfer_plan(cfg, args)
        engine = rollout_backend(cfg.parallel.rollout.engine).split(cfg, args, plan)
        set_seed(cfg.trainer.seed, engine.groups)
        self.engine = engine
        self.roles: Dict[str, Any] = {"rollout": Rollout(engine)}
        return {"rank": torch.distributed.get_rank(), "dp": engine.groups.layout.dp,
                "dp_rank": engine.groups.dp_rank, "collect": engine.groups.tp_rank == 0,
                "gen_layout": str(plan.gen), "verbs": {"rollout": declared_verbs(Rollout)}}

    def connect_weights(self, address: str, port: int) -> None:
        """Join the process group spanning the trainer's ranks and these (collective over both)."""
        self.engine.connect_weights(address, port)

    def sync_bytes(self) -> Optional[Tuple[int, int]]:
        """(bytes this rank received in the last sync, bytes of its generation shard); None where
        the engines take whole tensors and keep their shard (SGLang)."""
        return self.engine.sync_bytes()

    def peak_rss_gb(self) -> float:
        return peak_rss_gb()

    def call(self, role: str, name: str, *args, **kwargs) -> Any:
        """Run verb ``name`` of ``role`` (the rollout's verbs all run on every rank alike)."""
        declared_verbs(type(self.roles[role]))[name]  # an undeclared verb fails here, as on the trainer
        with progress.phase(f"{role}.{name}"):  # the phase a hang is named in
            return getattr(self.roles[role], name)(*args, **kwargs)
