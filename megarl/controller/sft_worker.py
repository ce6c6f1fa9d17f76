"""The SPMD workers of ``megarl sft``, ``megarl train-rm`` and ``megarl dpo``: on each rank the model trained
(``model.path``'s weights, in the actor's layout, with LoRA adapters when ``model.lora.rank`` is
set) as the ``actor`` of a run checkpoint, so ``megarl export-hf``, ``model.path=RUN_DIR`` and a
resume read it as an RL run's. Checkpoints and calls are
:class:`~megarl.controller.rl_worker.RLWorker`'s; no rollout is built."""

from __future__ import annotations

from typing import Dict

import torch

from megarl.controller.rl_worker import RLWorker
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching
from megarl.engines.offload import PhaseOffload
from megarl.engines.train_state import build_train_state
from megarl.models.hf_config import megatron_args_from_hf
from megarl.parallel import Layout, build_groups
from megarl.runtime import progress, set_seed


class SFTWorker(RLWorker):
    value_head = False  # the trained model's head: the vocabulary (a causal LM), or a scalar

    def learner(self, engine: MegatronEngine):
        from megarl.roles.sft import SupervisedLM

        cfg = self.cfg
        return SupervisedLM(engine, self.groups, MicroBatching(micro_batch_size=cfg.data.micro_batch_size,
                                                               packed=cfg.data.pack_sequences))

    def setup(self, master_addr: str, master_port: int) -> Dict:
        self.join(master_addr, master_port)
        cfg = self.cfg
        self.peak_tflops = None
        layout = Layout.from_config(cfg.parallel.actor, torch.distributed.get_world_size())
        self.groups = build_groups(layout)
        set_seed(cfg.trainer.seed, self.groups)
        args = megatron_args_from_hf(cfg.model.hf_config)
        state = build_train_state(cfg.model, cfg.optimizer, self.groups, cfg.trainer.train_steps,
                                  init_checkpoint=cfg.model.path, value_head=self.value_head,
                                  reward_head=self.value_head)
        progress.tick()
        engine = MegatronEngine(state, None if self.value_head else args.vocab_size,
                                max_bad_steps=cfg.trainer.max_bad_steps)
        self.roles = {"actor": self.learner(engine)}
        self.phases = PhaseOffload([state], False, False, False)  # the checkpoint verbs' residency
        return self.collect_info(layout)


class RMWorker(SFTWorker):
    """``megarl train-rm``: a value head on ``model.path``'s backbone (a causal LM's, whose
    vocabulary projection is dropped, or a reward model's own head)."""

    value_head = True

    def learner(self, engine: MegatronEngine):
        from megarl.roles.reward_trainer import RewardLearner

        cfg = self.cfg  # data.micro_batch_size counts pairs: two rows each
        return RewardLearner(engine, self.groups, MicroBatching(micro_batch_size=2 * cfg.data.micro_batch_size,
                                                                packed=cfg.data.pack_sequences))


class DPOWorker(SFTWorker):
    """``megarl dpo``: the policy (a causal LM, ``model.path``) and its frozen reference, the same
    starting weights: a copy in the same layout, or with LoRA the policy with its adapters off."""

    def learner(self, engine: MegatronEngine):
        from megarl.engines.train_state import build_frozen_state, copy_weights
        from megarl.roles.dpo import DPOLearner

        cfg, algo = self.cfg, self.cfg.algorithm
        if cfg.model.lora.rank:
            reference = engine
        else:
            frozen = build_frozen_state(cfg.model, self.groups)
            copy_weights(engine.state, frozen)
            reference = MegatronEngine(frozen, engine.vocab_size)
            progress.tick()
        how = MicroBatching(micro_batch_size=2 * cfg.data.micro_batch_size, packed=cfg.data.pack_sequences)
        return DPOLearner(engine, reference, self.groups, how, algo.dpo_beta, algo.dpo_loss, algo.dpo_label_smoothing)
