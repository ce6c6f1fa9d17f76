"""The native backend: the actor's own Megatron model in the generation layout with a KV cache
(megarl.rollout.native), fed in process (micro-DP resharding) when colocated and point to point
when split. Runs on CPU and GPU."""

from __future__ import annotations

from megarl.config.schema import Engine, WeightSync
from megarl.rollout.backends import RolloutBackend, rollout_dtype, transfer_plan


class NativeBackend(RolloutBackend):
    name = Engine.native
    records_routing = True
    sliding_window = True  # the Megatron model itself, SDPA core attention (decode reads the window)
    hf_weight_names = False  # the Megatron model's own tensors
    gated_delta_net = True  # megarl's layer keeps each row's convolution and recurrent state
    partial_rollout = True  # NativeRollout.begin/advance
    sample_streaming = True  # NativeRollout.admit

    def colocated(self, cfg, args, regrouping, train_chunks):
        from megarl.rollout.native import NativeRollout

        r = cfg.parallel.rollout
        return NativeRollout.colocated(cfg.model, args, regrouping, train_chunks, bucket_bytes=r.bucket_mb << 20,
                                       delta=r.weight_sync == WeightSync.delta, dtype=rollout_dtype(r),
                                       record_routing=bool(args.num_experts),
                                       recompute_kv_after_sync=r.recompute_kv_after_sync)

    def split(self, cfg, args, plan):
        from megarl.rollout.native import NativeRollout
        from megarl.transports.p2p import P2PReceiver

        r = cfg.parallel.rollout
        return NativeRollout(cfg.model, args, P2PReceiver(plan, seed=cfg.trainer.seed), dtype=rollout_dtype(r),
                             record_routing=bool(args.num_experts), recompute_kv_after_sync=r.recompute_kv_after_sync)

    def sender(self, cfg, args, layout, train_chunks):
        from megarl.transports.p2p import P2PSender

        return P2PSender(transfer_plan(cfg, args), train_chunks)
