"""The SGLang backend (GPU, extra ``sglang``): an SGLang engine per generation replica
(megarl.rollout.sglang_engine), fed by CUDA-IPC hand-over when colocated and by an NCCL
broadcast of whole HF tensors when split."""

from __future__ import annotations

import importlib.util
from typing import Dict, List

from megarl.config.schema import Engine, Placement, RolloutDtype
from megarl.rollout.backends import RolloutBackend


class SGLangBackend(RolloutBackend):
    name = Engine.sglang
    needs_gpus = True
    delta_sync = False  # SGLang's update takes whole HF tensors (CUDA-IPC handles, NCCL broadcast)

    def check(self, cfg) -> None:
        from megarl.config import ConfigError

        r = cfg.parallel.rollout
        if r.dtype != RolloutDtype.auto:
            raise ConfigError(f"parallel.rollout.dtype={r.dtype} applies to the native engine; SGLang generates in "
                              f"the actor's dtype (model.params_dtype): leave parallel.rollout.dtype=auto")

    def check_available(self, cfg) -> None:
        import torch

        from megarl.config import ConfigError

        # on a cluster the workers' nodes decide (gpu_assignment); a private Ray has this machine's GPUs
        if not cfg.trainer.ray_address and not torch.cuda.is_available():
            raise ConfigError("parallel.rollout.engine=sglang needs CUDA GPUs, and this machine has none; use "
                              "parallel.rollout.engine=native here (--dry-run prints an SGLang run's plan anywhere)")
        if importlib.util.find_spec("sglang") is None:
            raise ConfigError("parallel.rollout.engine=sglang needs SGLang: pip install 'megarl[sglang]' (or use "
                              "the Dockerfile's image)")

    def worker_env(self) -> Dict[str, str]:
        from megarl.rollout.sglang_engine import worker_env

        return worker_env()

    def plan_lines(self, cfg, gen, placement) -> List[str]:
        r, off = cfg.parallel.rollout, cfg.trainer.offload
        engines = f"{gen.dp} SGLang engine(s) (tp_size={gen.tp}, one per generation replica, started by its TP rank 0)"
        if placement == Placement.split:
            return [f"sglang: {engines} on the rollout's ranks; each sync broadcasts whole HF tensors in "
                    f"{r.bucket_mb} MiB buckets from trainer rank 0 over an NCCL group with the engines "
                    f"(update_weights_from_distributed); needs CUDA and the sglang extra"]
        offloaded = ", ".join(k for k in ("params", "grads", "optimizer") if getattr(off, k)) or "nothing"
        return [f"sglang: {engines} on the training ranks; each step: generate → release SGLang's memory → train → "
                f"resume its weights → sync (update_weights_from_tensor, CUDA-IPC handles per generation-TP rank, "
                f"{r.bucket_mb} MiB buckets) → offload the trainer's state ({offloaded}) → resume SGLang's KV cache; "
                f"needs CUDA and the sglang extra"]

    def weight_path(self) -> str:
        return " (SGLang: update_weights_from_distributed)"

    def split_plan_lines(self, cfg, plan, layout, itemsize: int) -> List[str]:
        whole = plan.model.numel() * itemsize / 2**20  # whole tensors by broadcast, not shards point to point
        return [f"trainer rank    0: gathers each bucket's whole tensors over the actor's groups and broadcasts "
                f"{whole:.2f} MiB per sync",
                f"rollout ranks {plan.offset}..{plan.world_size - 1}: the SGLang engines receive the {whole:.2f} MiB "
                f"and load their own TP shards"]

    def colocated(self, cfg, args, regrouping, train_chunks):
        from megarl.rollout.sglang_engine import colocated_rollout

        return colocated_rollout(cfg.model, cfg.parallel.rollout, args, regrouping, train_chunks,
                                 tokenizer=cfg.data.tokenizer)

    def split(self, cfg, args, plan):
        from megarl.rollout.sglang_engine import split_rollout

        return split_rollout(cfg.model, cfg.parallel.rollout, args, plan.gen, tokenizer=cfg.data.tokenizer)

    def sender(self, cfg, args, layout, train_chunks):
        from megarl.transports.nccl_broadcast import BroadcastSender, SGLangBroadcaster, hf_bucket_plan

        r = cfg.parallel.rollout
        dtype = next(train_chunks[0].parameters()).dtype
        vocab = cfg.model.make_vocab_size_divisible_by
        plan = hf_bucket_plan(args, dtype, r.bucket_mb << 20, vocab)
        return BroadcastSender(SGLangBroadcaster(args, layout, train_chunks, plan, vocab), r.nproc)
