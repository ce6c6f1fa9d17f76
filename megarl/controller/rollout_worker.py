"""The SPMD worker of the rollout under split placement (``trainer.placement=split``): its own
ranks and ``torch.distributed`` world, the generation layout ``parallel.rollout`` as its only
Megatron layout, and weights received from the trainer's ranks over the process group that
spans both (:mod:`megarl.hybrid.transfer`). Generation here runs while the trainer trains.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from megarl.hybrid.transfer import ShardReceiver, connect
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
        from megarl.controller.split import transfer_plan
        from megarl.models.hf_config import megatron_args_from_hf
        from megarl.rollout.native import NativeRollout

        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        cfg, r = self.cfg, self.cfg.parallel.rollout
        init_distributed(progress.collective_timeout_s(cfg.trainer.hang_timeout_s))
        args = megatron_args_from_hf(cfg.model.hf_config)
        plan = transfer_plan(cfg, args)
        if r.engine == "sglang":
            engine = self._sglang(args, plan.gen)
        else:
            engine = NativeRollout(cfg.model, args, plan, dtype=None if r.dtype == "auto" else r.dtype,
                                   record_routing=bool(args.num_experts), seed=cfg.trainer.seed)
        set_seed(cfg.trainer.seed, engine.groups)
        self.engine = engine
        self.roles: Dict[str, Any] = {"rollout": Rollout(engine)}
        return {"rank": torch.distributed.get_rank(), "dp": engine.groups.layout.dp,
                "dp_rank": engine.groups.dp_rank, "collect": engine.groups.tp_rank == 0,
                "gen_layout": str(plan.gen), "verbs": {"rollout": declared_verbs(Rollout)}}

    def _sglang(self, args, layout):
        """SGLang engines of this world's generation replicas, fed by the trainer's broadcasts."""
        from megarl.models.builder import resolve_dtype
        from megarl.parallel import build_groups
        from megarl.rollout.sglang_engine import SGLangRollout, hf_bucket_plan, write_hf_dir

        cfg, r = self.cfg, self.cfg.parallel.rollout
        groups = build_groups(layout)
        dtype = resolve_dtype(cfg.model.params_dtype)  # the trainer's parameters', as the broadcast sends them
        vocab = cfg.model.make_vocab_size_divisible_by
        hf_dir = write_hf_dir(args.hf_config, dtype, cfg.data.tokenizer) if groups.tp_rank == 0 else ""
        return SGLangRollout(groups, args, hf_dir, dtype, mem_fraction=r.mem_fraction_static,
                             bucket_bytes=r.bucket_mb << 20, vocab_multiple=vocab,
                             weights_plan=hf_bucket_plan(args, dtype, r.bucket_mb << 20, vocab))

    def connect_weights(self, address: str, port: int) -> None:
        """Join the process group spanning the trainer's ranks and these (collective over both)."""
        if self.cfg.parallel.rollout.engine == "sglang":
            self.engine.connect_weights_group(address, port)
            return
        plan = self.engine.resharder.plan
        self.engine.connect(connect(address, port, plan.offset + self.rank, plan.world_size))

    def sync_bytes(self) -> Optional[Tuple[int, int]]:
        """(bytes this rank received in the last sync, bytes of its generation shard); None for
        SGLang, whose engines take whole tensors and keep their shard."""
        receiver = self.engine.resharder
        if not isinstance(receiver, ShardReceiver):
            return None
        return receiver.last.bytes_received, receiver.shard_bytes()

    def peak_rss_gb(self) -> float:
        return peak_rss_gb()

    def call(self, role: str, name: str, *args, **kwargs) -> Any:
        """Run verb ``name`` of ``role`` (the rollout's verbs all run on every rank alike)."""
        declared_verbs(type(self.roles[role]))[name]  # an undeclared verb fails here, as on the trainer
        with progress.phase(f"{role}.{name}"):  # the phase a hang is named in
            return getattr(self.roles[role], name)(*args, **kwargs)
