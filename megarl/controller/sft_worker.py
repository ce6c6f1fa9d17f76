"""The SPMD worker of ``megarl sft``: on each rank the model trained (``model.path``'s weights, in
the actor's layout, with LoRA adapters when ``model.lora.rank`` is set) as the ``actor`` of a run
checkpoint, so ``megarl export-hf``, ``model.path=RUN_DIR`` and a resume read it as an RL run's.
Checkpoints and calls are :class:`~megarl.controller.rl_worker.RLWorker`'s; no rollout is built."""

from __future__ import annotations

from typing import Dict

import torch

from megarl.controller.rl_worker import RLWorker
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.offload import PhaseOffload
from megarl.engines.train_state import build_train_state
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.roles.sft import SupervisedLM
from megarl.runtime import progress, set_seed


class SFTWorker(RLWorker):
    def setup(self, master_addr: str, master_port: int) -> Dict:
        self.join(master_addr, master_port)
        cfg = self.cfg
        self.peak_tflops = None
        layout = Layout.from_config(cfg.parallel.actor, torch.distributed.get_world_size())
        self.groups = build_groups(layout)
        set_seed(cfg.trainer.seed, self.groups)
        args = megatron_args_from_hf(cfg.model.hf_config)
        state = build_train_state(cfg.model, cfg.optimizer, self.groups, cfg.trainer.train_steps,
                                  init_checkpoint=cfg.model.path)
        progress.tick()
        how = MicroBatching(micro_batch_size=cfg.data.micro_batch_size, packed=cfg.data.pack_sequences)
        engine = MegatronEngine(state, args.vocab_size, max_bad_steps=cfg.trainer.max_bad_steps)
        self.roles = {"actor": SupervisedLM(engine, self.groups, how)}
        self.phases = PhaseOffload([state], False, False, False)  # the checkpoint verbs' residency
        return self.collect_info(layout)
