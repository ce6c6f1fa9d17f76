"""The SPMD worker of the trained roles: on each rank the actor, reference and critic (and, with
colocated placement, the rollout: the 3D-HybridEngine time-shares the device between them) share
the process; with split placement the rollout has its own ranks (megarl.controller.rollout_worker)
and this rank sends it weights. The driver calls
the verbs each role class declares (megarl.protocol.verb) through :meth:`RLWorker.call`, via the
:class:`~megarl.controller.group.RoleProxy` of each role.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from megarl.algorithms.presets import preset, resolve
from megarl.checkpoint.train_state import load_train_state, save_train_state, weights_checksum
from megarl.config.schema import REWARD_MODEL, Placement
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching, MiniBatches
from megarl.engines.offload import KINDS, PhaseOffload, offload
from megarl.engines.train_state import build_frozen_state, build_train_state, copy_weights
from megarl.hybrid import regroup
from megarl.models.flops import gpu_peak_tflops
from megarl.models.hf_config import megatron_args_from_hf, read_hf_config
from megarl.parallel import Layout, build_groups
from megarl.protocol import Batch, Columns, Dispatch, declared_verbs
from megarl.roles.actor import Actor, ActorLossConfig
from megarl.roles.critic import Critic, CriticLossConfig
from megarl.roles.reference import Reference
from megarl.roles.rollout import Rollout
from megarl.rollout.backends import rollout_backend
from megarl.runtime import init_distributed, peak_gpu_gb, peak_rss_gb, progress, set_seed
from megarl.runtime.devices import to_device, to_host
from megarl.runtime.memory import device_used_gb, peak_gpu_reserved_gb

def needs_reference(algo) -> bool:
    return algo.kl_coef > 0


def needs_critic(algo) -> bool:
    return preset(algo).critic


class RLWorker:
    """One rank of the trainer's worker group."""

    def __init__(self, rank: int, world_size: int, config):
        # the driver sends a resolved config; resolving again keeps a direct caller's defaults right
        config = dataclasses.replace(config, algorithm=resolve(config.algorithm))
        self.rank, self.world_size, self.cfg = rank, world_size, config

    def rendezvous(self):
        from megarl.controller.group import rendezvous_address

        return rendezvous_address(local=self.cfg.trainer.nnodes == 1)

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the group's torch.distributed world (rank 0's rendezvous)."""
        local_rank = self.rank % self.cfg.trainer.nproc_per_node
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        init_distributed(progress.collective_timeout_s(self.cfg.trainer.hang_timeout_s))

    def collect_info(self, layout) -> Dict:
        """What the driver keeps of this rank: its DP index, whether it answers for it (TP rank 0
        of the last stage, CP rank 0: CP ranks gather whole sequences, so each holds the full
        result), and the verbs of its roles."""
        g = self.groups
        return {"rank": torch.distributed.get_rank(), "dp": layout.dp, "dp_rank": g.dp_rank,
                "collect": g.tp_rank == 0 and g.is_last_stage and g.pg.cp.rank() == 0,
                "verbs": {name: declared_verbs(type(role)) for name, role in self.roles.items()}}

    def setup(self, master_addr: str, master_port: int) -> Dict:
        self.join(master_addr, master_port)
        cfg, algo = self.cfg, self.cfg.algorithm
        self.peak_tflops = gpu_peak_tflops(cfg.logging.gpu_peak_tflops,
                                           torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        layout = Layout.from_config(cfg.parallel.actor, torch.distributed.get_world_size())
        self.groups = build_groups(layout)
        set_seed(cfg.trainer.seed, self.groups)
        args = megatron_args_from_hf(cfg.model.hf_config)
        # LR schedules count optimizer steps: one per PPO mini-batch and epoch of each RL step
        rows = cfg.data.prompts_per_step * algo.samples_per_prompt
        steps = cfg.trainer.train_steps * (rows // (algo.ppo_mini_batch_size or rows)) * algo.ppo_epochs
        state = build_train_state(cfg.model, cfg.optimizer, self.groups, steps, init_checkpoint=cfg.model.path)
        progress.tick()  # start-up advances: each model built (the hang check's progress)
        loss = ActorLossConfig(
            policy_loss=algo.policy_loss, agg_mode=algo.agg_mode, clip_low=algo.clip_low, clip_high=algo.clip_high,
            dual_clip_c=algo.clip_ratio_c if algo.policy_loss == "ppo" else None,  # gspo has none
            kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef, kl_estimator=algo.kl_estimator,
            entropy_coef=algo.entropy_coef, positive_nll_coef=algo.positive_nll_coef, max_len=algo.max_new_tokens,
            temperature=algo.temperature,
            rollout_correction=algo.rollout_correction,
            rollout_correction_threshold=algo.rollout_correction_threshold,
            rollout_correction_threshold_low=algo.rollout_correction_threshold_low)
        bad = cfg.trainer.max_bad_steps
        # this rank's roles by name; the driver reaches their declared verbs through call()
        self.roles: Dict[str, Any] = {"actor": Actor(MegatronEngine(state, args.vocab_size, max_bad_steps=bad), loss)}
        if needs_reference(algo) and cfg.model.lora.rank:  # the base: the actor with its adapters off
            self.roles["reference"] = Reference(self.roles["actor"].engine, algo.temperature, adapters_off=True)
        elif needs_reference(algo):  # a frozen copy of the initial policy, same layout
            ref_state = build_frozen_state(cfg.model, self.groups)
            copy_weights(state, ref_state)
            progress.tick()
            self.roles["reference"] = Reference(MegatronEngine(ref_state, args.vocab_size), algo.temperature)
        if needs_critic(algo):
            optim = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr or cfg.optimizer.lr)
            critic_state = build_train_state(cfg.model, optim, self.groups, steps, value_head=True)
            copy_weights(state, critic_state)  # the actor's backbone; a new value head
            progress.tick()
            self.roles["critic"] = Critic(MegatronEngine(critic_state, None, max_bad_steps=bad), CriticLossConfig(
                clip_range=algo.clip_low, agg_mode=algo.agg_mode, max_len=algo.max_new_tokens))
        if preset(algo).prm:  # PRIME's implicit PRM, in the actor's layout
            self.roles["prm"] = self._implicit_prm(state, args, steps)
        if algo.reward_fn == REWARD_MODEL and not cfg.reward_model.generative:  # a scalar head, in the actor's layout
            from megarl.roles.reward_model import RewardModel

            rm = cfg.reward_model
            rm_cfg = dataclasses.replace(cfg.model, path=None, hf_config=rm.hf_config or cfg.model.hf_config)
            rm_state = build_frozen_state(rm_cfg, self.groups, rm.path or rm.checkpoint, value_head=True)
            progress.tick()
            # an HF sequence-classifier scores where transformers does: its last non-pad token
            pad = read_hf_config(rm_cfg.hf_config).get("pad_token_id") if rm.path else None
            self.roles["reward_model"] = RewardModel(MegatronEngine(rm_state, None), pad)
        r = cfg.parallel.rollout
        off = cfg.trainer.offload
        # the reference's frozen parameters go too (under ``params``); the reward model scores while generating
        states = {id(role.engine.state): role.engine.state for name, role in self.roles.items() if name != "reward_model"}
        if "prm" in self.roles:  # the PRM's own reference (reward_model.path; else it is the policy's, or a copy)
            states.setdefault(id(self.roles["prm"].reference.state), self.roles["prm"].reference.state)
        self.phases = PhaseOffload(list(states.values()), off.params, off.grads, off.optimizer)
        if args.num_experts:  # moe/routing_mismatch_frac is logged with and without replay
            self.roles["actor"].engine.track_routing(replay=algo.routing_replay)
        self.how = MicroBatching(max_tokens=cfg.data.micro_batch_tokens, packed=cfg.data.pack_sequences)
        backend = rollout_backend(r.engine)
        if cfg.trainer.placement == Placement.split:  # the rollout has its own ranks: this rank sends it weights
            self.sender = backend.sender(cfg, args, layout, state.model)
            return self.collect_info(layout)
        regrouping = regroup(layout, r.tp, r.pp, r.ep, args.num_experts or 0)
        # The engine starts with the trained states off the device (vLLM refuses to start below its
        # gpu_memory_utilization of free memory, SGLang sizes its pool from what is free), and gives
        # its memory back before they return; its weights come back for the first sync, its KV cache
        # once the trainer has offloaded after it (as every step).
        away = [offload(s, KINDS) for s in self.phases.states]
        torch.cuda.empty_cache()  # the freed blocks back to the device, for the engine's processes
        engine = backend.colocated(cfg, args, regrouping, state.model)
        engine.release_memory()
        if cfg.reward_model.generative:  # the judge's engine starts as the policy's, then sleeps
            self.roles["judge"] = self._judge(layout)
        for handle in away:
            handle.reload()
        engine.resume_memory()
        self.roles["rollout"] = Rollout(engine, self.phases)
        return self.collect_info(layout) | {"micro_dp_group": list(regrouping.micro_dp_group(torch.distributed.get_rank())),
                                            "gen_layout": str(regrouping.gen)}

    def _implicit_prm(self, policy_state, args, steps: int):
        """PRIME's PRM: a trained causal LM from the policy's starting weights (its reference the
        policy's reference, shared) or from reward_model.path (its reference a frozen copy of it)."""
        from megarl.roles.prm import ImplicitPRM

        cfg, algo, rm = self.cfg, self.cfg.algorithm, self.cfg.reward_model
        optim = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr if algo.prm_lr is None else algo.prm_lr)
        bad = cfg.trainer.max_bad_steps
        if rm.path:
            prm_cfg = dataclasses.replace(cfg.model, path=rm.path, hf_config=rm.hf_config)
            prm_state = build_train_state(prm_cfg, optim, self.groups, steps, init_checkpoint=rm.path)
            ref = MegatronEngine(build_frozen_state(prm_cfg, self.groups, rm.path), args.vocab_size)
            shared = False
        else:
            prm_state = build_train_state(cfg.model, optim, self.groups, steps)
            copy_weights(policy_state, prm_state)  # the policy's starting weights
            shared = "reference" in self.roles
            if shared:
                ref = self.roles["reference"].engine
            else:  # kl_coef 0: a frozen copy of the initial policy for the PRM alone
                ref_state = build_frozen_state(cfg.model, self.groups)
                copy_weights(policy_state, ref_state)
                ref = MegatronEngine(ref_state, args.vocab_size)
        progress.tick()
        return ImplicitPRM(MegatronEngine(prm_state, args.vocab_size, max_bad_steps=bad), ref, algo.prm_beta,
                           algo.temperature, shares_policy_reference=shared)

    def _judge(self, layout):
        """reward_model.generative's judge: its frozen weights, built in the actor's layout from
        reward_model.path, feed a rollout backend's engine (reward_model.engine) in the generation
        layout of parallel.rollout, which sleeps until the driver calls it."""
        from megarl.config.schema import LoRAConfig, WeightSync
        from megarl.roles.judge import Judge

        cfg, rm, r = self.cfg, self.cfg.reward_model, self.cfg.parallel.rollout
        judge_model = dataclasses.replace(cfg.model, path=rm.path, hf_config=rm.hf_config, lora=LoRAConfig())
        args = megatron_args_from_hf(rm.hf_config)
        state = build_frozen_state(judge_model, self.groups, rm.path)
        progress.tick()
        engine = rm.engine or r.engine
        judge_cfg = dataclasses.replace(cfg, model=judge_model, parallel=dataclasses.replace(
            cfg.parallel, rollout=dataclasses.replace(r, engine=engine, weight_sync=WeightSync.full)))
        regrouping = regroup(layout, r.tp, r.pp, r.ep if args.num_experts else 1, args.num_experts or 0)
        judge = rollout_backend(engine).colocated(judge_cfg, args, regrouping, state.model)
        judge.release_memory()
        return Judge(judge)

    # ------------------------------------------------------------------ split placement
    def connect_weights(self, address: str, port: int) -> None:
        """Join the process group spanning these ranks and the rollout's (collective over both)."""
        self.sender.connect(address, port)

    def publish_weights(self) -> Tuple[int, int, int]:
        """Send the actor's current weights to the rollout's ranks; the bytes this rank sent, its
        peak extra memory in the sync and the copy it keeps of what it sent (weight_sync=delta)."""
        sent = self.sender.send()
        stats = self.sender.last_stats()
        return sent, getattr(stats, "peak_extra_bytes", 0), getattr(stats, "delta_copy_bytes", 0)

    # ------------------------------------------------------------------ checkpoints
    def _trained(self):
        return {name: self.roles[name].engine.state for name in ("actor", "critic", "prm") if name in self.roles}

    def save_checkpoint(self, path: str) -> None:
        """Write the trained roles under ``path``; with ``trainer.async_save`` the tensors are
        still being written when this returns (see :meth:`finish_checkpoint`)."""
        t = self.cfg.trainer
        if t.async_save and getattr(self, "save_queue", None) is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.save_queue = AsyncCallsQueue()
        # an async save may still read the tensors after this returns: they stay on the device
        with self.phases.resident(offload_after=not t.async_save):
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
        with self.phases.resident():
            return all([load_train_state(state, Path(path) / name) for name, state in self._trained().items()])

    def actor_weights_checksum(self) -> float:
        with self.phases.resident():
            return weights_checksum(self.roles["actor"].engine.state)

    # ------------------------------------------------------------------ verbs
    def call(self, role: str, name: str, *args, **kwargs) -> Any:
        """Run verb ``name`` of ``role`` on this rank. A DP verb gets its :class:`Batch` chunk
        as the engine's inputs and its result wrapped back: a tensor as the :class:`Columns` of
        the Batch column the verb names, metrics as a dict."""
        with progress.phase(f"{role}.{name}"):  # the phase a hang is named in
            return self._call(role, name, *args, **kwargs)

    def _call(self, role: str, name: str, *args, **kwargs) -> Any:
        spec = declared_verbs(type(self.roles[role]))[name]
        method = getattr(self.roles[role], name)
        if spec.dispatch is not Dispatch.DP:
            return to_host(method(*args, **kwargs))
        (batch,) = args
        tensors, lengths = batch.engine_inputs()
        tensors = to_device(tensors)  # the one move onto this rank's device; row lengths stay on the host
        mini = (self._mini_batches(batch),) if spec.optimizer_steps else ()
        result = method(tensors, lengths, self.how, *mini, **kwargs)
        if spec.output is not None:
            out = Columns({spec.output: to_host(result)})  # the driver may have no GPU
            engine = self.roles[role].engine
            if "routing" in tensors and engine.routers:  # a routing-tracked pass (the actor's); reduced over all ranks
                out.routing_metrics = {f"moe/{k}": v for k, v in engine.routing_mismatch.items()}
            return out
        metrics = {spec.metrics_prefix + k: v for k, v in result.items()}
        if spec.optimizer_steps:
            # The driver hears from one rank and may have no GPU: the memory peaks of all ranks and
            # this GPU's peak FLOP/s (the MFU denominator) travel with the update's metrics.
            metrics.update(self._peak_memory())
            if self.peak_tflops is not None:
                metrics["perf/gpu_peak_tflops"] = self.peak_tflops
        return metrics

    def _mini_batches(self, batch: Batch) -> MiniBatches:
        """This step's PPO mini-batches; the shuffle seed comes from the batch's policy version
        (its step), which every rank sees alike, so all ranks draw the same permutation."""
        algo = self.cfg.algorithm
        return MiniBatches(algo.ppo_mini_batch_size or 0, algo.ppo_epochs,
                           seed=self.cfg.trainer.seed + batch.policy_version + 1)

    def _peak_memory(self) -> Dict[str, float]:
        """Peak host RSS (and GPU memory: torch's allocated and reserved peaks, and the device's
        use now, which counts the rollout engines' processes) of the run so far, the max over all ranks."""
        cuda = torch.cuda.is_available()
        gpu = [peak_gpu_gb(), peak_gpu_reserved_gb(), device_used_gb()] if cuda else [0.0, 0.0, 0.0]
        peaks = torch.tensor([peak_rss_gb(), *gpu], device="cuda" if cuda else "cpu")
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
        out = {"memory/worker_peak_rss_gb": peaks[0].item()}
        if cuda:
            out["memory/worker_peak_gpu_gb"] = peaks[1].item()
            out["memory/worker_peak_gpu_reserved_gb"] = peaks[2].item()
            out["memory/device_used_gb"] = peaks[3].item()
        return out
