"""The SPMD worker of colocated placement: on each rank the actor, reference, critic and rollout
share the process (the 3D-HybridEngine time-shares the device between them). The driver calls
its methods through :class:`WorkerGroup` proxies; method names are ``<role>_<verb>``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from megarl.controller.protocol import Batch
from megarl.algorithms.presets import preset, resolve
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching, MiniBatches
from megarl.hybrid import regroup
from megarl.models.flops import gpu_peak_tflops
from megarl.models.hf_config import megatron_args_from_hf, read_hf_config
from megarl.parallel import Layout, build_groups
from megarl.roles.actor import Actor, ActorLossConfig
from megarl.roles.critic import Critic, CriticLossConfig
from megarl.roles.reference import Reference
from megarl.rollout import Response, SamplingParams
from megarl.runtime import init_distributed, peak_gpu_gb, peak_rss_gb, set_seed
from megarl.training import lm

def needs_reference(algo) -> bool:
    return algo.kl_coef > 0


def needs_critic(algo) -> bool:
    return preset(algo).critic


class RLWorker:
    """One rank of the colocated worker group."""

    def __init__(self, rank: int, world_size: int, config):
        # the driver sends a resolved config; resolving again keeps a direct caller's defaults right
        config = dataclasses.replace(config, algorithm=resolve(config.algorithm))
        self.rank, self.world_size, self.cfg = rank, world_size, config

    def rendezvous(self):
        from megarl.controller.group import rendezvous_address

        return rendezvous_address(local=self.cfg.trainer.nnodes == 1)

    def setup(self, master_addr: str, master_port: int) -> Dict:
        local_rank = self.rank % self.cfg.trainer.nproc_per_node
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        cfg, algo = self.cfg, self.cfg.algorithm
        init_distributed()
        self.peak_tflops = gpu_peak_tflops(cfg.logging.gpu_peak_tflops,
                                           torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        layout = Layout.from_config(cfg.parallel.actor, torch.distributed.get_world_size())
        self.groups = build_groups(layout)
        set_seed(cfg.trainer.seed, self.groups)
        args = megatron_args_from_hf(cfg.model.hf_config)
        # LR schedules count optimizer steps: one per PPO mini-batch and epoch of each RL step
        rows = cfg.data.prompts_per_step * algo.samples_per_prompt
        steps = cfg.trainer.train_steps * (rows // (algo.ppo_mini_batch_size or rows)) * algo.ppo_epochs
        state = lm.build_train_state(cfg.model, cfg.optimizer, self.groups, steps, init_checkpoint=cfg.model.path)
        loss = ActorLossConfig(
            policy_loss=algo.policy_loss, agg_mode=algo.agg_mode, clip_low=algo.clip_low, clip_high=algo.clip_high,
            kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef, kl_estimator=algo.kl_estimator,
            entropy_coef=algo.entropy_coef, max_len=algo.max_new_tokens, temperature=algo.temperature,
            rollout_correction=algo.rollout_correction,
            rollout_correction_threshold=algo.rollout_correction_threshold)
        bad = cfg.trainer.max_bad_steps
        self.actor = Actor(MegatronEngine(state, args.vocab_size, max_bad_steps=bad), loss)
        self.reference = None
        if needs_reference(algo):  # a frozen copy of the initial policy, same layout
            ref_state = lm.build_frozen_state(cfg.model, self.groups)
            lm.copy_weights(state, ref_state)
            self.reference = Reference(MegatronEngine(ref_state, args.vocab_size), algo.temperature)
        self.critic = None
        if needs_critic(algo):
            optim = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr or cfg.optimizer.lr)
            critic_state = lm.build_train_state(cfg.model, optim, self.groups, steps, value_head=True)
            lm.copy_weights(state, critic_state)  # the actor's backbone; a new value head
            self.critic = Critic(MegatronEngine(critic_state, None, max_bad_steps=bad), CriticLossConfig(
                clip_range=algo.clip_low, agg_mode=algo.agg_mode, max_len=algo.max_new_tokens))
        self.reward_model = None
        if algo.reward_fn == "model":  # colocated, in the actor's layout
            from megarl.roles.reward_model import RewardModel

            rm = cfg.reward_model
            rm_cfg = dataclasses.replace(cfg.model, path=None, hf_config=rm.hf_config or cfg.model.hf_config)
            rm_state = lm.build_frozen_state(rm_cfg, self.groups, rm.path or rm.checkpoint, value_head=True)
            # an HF sequence-classifier scores where transformers does: its last non-pad token
            pad = read_hf_config(rm_cfg.hf_config).get("pad_token_id") if rm.path else None
            self.reward_model = RewardModel(MegatronEngine(rm_state, None), pad)
        r = cfg.parallel.rollout
        regrouping = regroup(layout, r.tp, r.pp, r.ep, args.num_experts or 0)
        if r.engine != "native":
            raise ValueError(f"parallel.rollout.engine='{r.engine}': colocated RL on this machine runs the "
                             f"native engine; sglang needs GPUs (benchmarks/gpu/check_rollout.sh)")
        from megarl.rollout.native import NativeRollout

        self.rollout = NativeRollout(cfg.model, args, regrouping, state.model, bucket_bytes=r.bucket_mb << 20,
                                     dtype=None if r.dtype == "auto" else r.dtype,
                                     record_routing=bool(args.num_experts))
        if args.num_experts:  # moe/routing_mismatch_frac is logged with and without replay
            self.actor.engine.track_routing(replay=algo.routing_replay)
        self.how = MicroBatching(max_tokens=cfg.data.micro_batch_tokens)
        g = self.groups
        return {"rank": torch.distributed.get_rank(), "dp": layout.dp, "dp_rank": g.dp_rank,
                "collect": g.tp_rank == 0 and g.is_last_stage,
                "micro_dp_group": list(regrouping.micro_dp_group(torch.distributed.get_rank())),
                "gen_layout": str(regrouping.gen)}

    # ------------------------------------------------------------------ checkpoints
    def _trained(self):
        states = {"actor": self.actor.engine.state}
        if self.critic is not None:
            states["critic"] = self.critic.engine.state
        return states

    def save_checkpoint(self, path: str) -> None:
        """Write the trained roles under ``path``; with ``trainer.async_save`` the tensors are
        still being written when this returns (see :meth:`finish_checkpoint`)."""
        from megarl.training.train_ckpt import save_train_state

        t = self.cfg.trainer
        if t.async_save and getattr(self, "save_queue", None) is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.save_queue = AsyncCallsQueue()
        for name, state in self._trained().items():
            save_train_state(state, Path(path) / name, t.checkpoint_format,
                             async_queue=self.save_queue if t.async_save else None)

    def finish_checkpoint(self, blocking: bool) -> bool:
        """Finalize background checkpoint writes that are done on every rank (all ranks agree);
        True when none is left. Collective."""
        queue = getattr(self, "save_queue", None)
        if queue is None:
            return True
        queue.maybe_finalize_async_calls(blocking=blocking)
        return queue.get_num_unfinalized_calls() == 0

    def load_checkpoint(self, path: str) -> bool:
        """Restore the trained roles; True when the checkpoint's layout is this one (RNG
        streams restored too), False after a re-layout."""
        from megarl.training.train_ckpt import load_train_state

        return all([load_train_state(state, Path(path) / name) for name, state in self._trained().items()])

    def actor_weights_checksum(self) -> float:
        from megarl.training.train_ckpt import weights_checksum

        return weights_checksum(self.actor.engine.state)

    # ------------------------------------------------------------------ rollout
    def rollout_generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> List[Response]:
        return self.rollout.generate(prompts, sampling)

    def rollout_update_weights(self, policy_version: int) -> Dict:
        self.rollout.update_weights(policy_version)
        s = self.rollout.resharder.last
        return {"sync/seconds": s.seconds, "sync/bytes_received": s.bytes_received}

    def rollout_release_memory(self) -> None:
        self.rollout.release_memory()

    def rollout_resume_memory(self) -> None:
        self.rollout.resume_memory()

    # ------------------------------------------------------------------ training roles
    @staticmethod
    def _inputs(batch: Batch):
        """The engine's [rows, seq] tensors (and MoE ``routing``), and the row lengths (per-row
        fields stay behind)."""
        return {k: v for k, v in batch.tensors.items() if v.dim() == 2 or k == "routing"}, batch["lengths"]

    def actor_compute_log_prob(self, batch: Batch) -> Batch:
        tensors, lengths = self._inputs(batch)
        out = Batch({"old_log_probs": self.actor.compute_log_prob(tensors, lengths, self.how)})
        if "routing" in tensors and self.actor.engine.routers:  # reduced over all ranks
            out.meta["routing_metrics"] = {f"moe/{k}": v for k, v in self.actor.engine.routing_mismatch.items()}
        return out

    def reference_compute_log_prob(self, batch: Batch) -> Batch:
        tensors, lengths = self._inputs(batch)
        return Batch({"ref_log_probs": self.reference.compute_log_prob(tensors, lengths, self.how)})

    def critic_compute_values(self, batch: Batch) -> Batch:
        tensors, lengths = self._inputs(batch)
        return Batch({"values": self.critic.compute_values(tensors, lengths, self.how)})

    def _mini_batches(self, batch: Batch) -> MiniBatches:
        """This step's PPO mini-batches; the shuffle seed comes from the batch's policy version
        (its step), which every rank sees alike, so all ranks draw the same permutation."""
        algo = self.cfg.algorithm
        return MiniBatches(algo.ppo_mini_batch_size or 0, algo.ppo_epochs,
                           seed=self.cfg.trainer.seed + batch.policy_version + 1)

    def actor_update(self, batch: Batch) -> Dict[str, float]:
        tensors, lengths = self._inputs(batch)
        metrics = self.actor.update(tensors, lengths, self.how, self._mini_batches(batch))
        # The driver hears from one rank and may have no GPU: the memory peaks of all ranks and
        # this GPU's peak FLOP/s (the MFU denominator) travel with the update's metrics.
        metrics.update(self._peak_memory())
        if self.peak_tflops is not None:
            metrics["perf/gpu_peak_tflops"] = self.peak_tflops
        return metrics

    def _peak_memory(self) -> Dict[str, float]:
        """Peak host RSS (and GPU memory) of the run so far, the max over all ranks."""
        cuda = torch.cuda.is_available()
        peaks = torch.tensor([peak_rss_gb(), peak_gpu_gb() if cuda else 0.0], device="cuda" if cuda else "cpu")
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
        out = {"memory/worker_peak_rss_gb": peaks[0].item()}
        if cuda:
            out["memory/worker_peak_gpu_gb"] = peaks[1].item()
        return out

    def reward_model_compute_scores(self, batch: Batch) -> Batch:
        tensors, lengths = self._inputs(batch)
        return Batch({"scores": self.reward_model.compute_scores(tensors, lengths, self.how)})

    def critic_update(self, batch: Batch) -> Dict[str, float]:
        tensors, lengths = self._inputs(batch)
        metrics = self.critic.update(tensors, lengths, self.how, self._mini_batches(batch))
        return {f"critic/{k}": v for k, v in metrics.items()}
